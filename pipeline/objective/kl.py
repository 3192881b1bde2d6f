"""The coefficient of KL-in-reward (`advantages.kl_in_reward`): fixed, or steered towards a target
KL (Ziegler et al. 2019). Plain Python, its state a small JSON dict saved with the trainer."""


class FixedKLController:
    """A constant KL-in-reward coefficient, with the adaptive controller's interface."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.coef = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.coef

    def state_dict(self) -> dict:
        return {"kind": "fixed", "coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "fixed")
        self.coef = float(state["coef"])


class AdaptiveKLController:
    """Ziegler et al. (2019): steer the per-completion KL toward `target` over `horizon` completions.

    error = clip(current_kl / target - 1, -0.2, 0.2);  coef *= 1 + error * n_steps / horizon.
    Multiplicative, so a coefficient of 0 stays 0.
    """

    def __init__(self, init_coef: float, target: float, horizon: int):
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs init_coef >= 0, target > 0, horizon > 0; got {init_coef}, {target}, {horizon}"
            )
        self.coef = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        current_kl = float(current_kl)
        if current_kl != current_kl or abs(current_kl) == float("inf"):
            raise ValueError(f"adaptive KL controller got a non-finite KL ({current_kl})")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)  # proportional error, +-20 % at most
        self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef

    def state_dict(self) -> dict:
        return {"kind": "adaptive", "coef": self.coef, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "adaptive")
        self.coef = float(state["coef"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def _check_kind(state: dict, kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"KL controller state is of kind {state.get('kind')!r}, expected {kind!r}")


def make_kl_controller(
    coef: float, target: float | None = None, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Adaptive controller when a target KL is set, else a fixed coefficient."""
    return FixedKLController(coef) if target is None else AdaptiveKLController(coef, target, horizon)
