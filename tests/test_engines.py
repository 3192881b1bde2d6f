"""Generation engines: in-place weight reload equals a fresh engine; vLLM agrees with HF."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from pipeline.config.rollout import RolloutConfig
from pipeline.logprobs import Batch, token_logprobs
from pipeline.run.policy import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_policies(assets, tmp_path_factory):
    """The tiny model and a copy whose (tied) embedding and one layer were perturbed."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("policies")
    a, b = root / "a", root / "b"
    shutil.copytree(assets["model"], a)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.add_(0.05 * torch.randn(emb.shape, generator=g))
        w = model.model.layers[0].mlp.down_proj.weight
        w.add_(0.05 * torch.randn(w.shape, generator=g))
    shutil.copytree(a, b)
    model.save_pretrained(b)
    return a, b


PROMPT = [[3, 4, 5, 6, 7, 8]]


def test_reloaded_vllm_engine_samples_like_a_fresh_one(two_policies):
    from pipeline.models.engines import cpu_env
    from pipeline.models.vllm_engine import VLLMEngine

    a, b = two_policies
    cfg = RolloutConfig(max_new_tokens=12)
    cpu_env()  # what the engine sets for itself on purpose
    env = dict(os.environ)
    fresh = VLLMEngine(b, cfg, 256, seed=0)
    # and nothing else: vLLM's LD_PRELOAD, KMP_*, ... for its worker processes stay out of
    # this process's environment, so a process started later does not inherit them
    assert dict(os.environ) == env
    want = fresh.generate(PROMPT, [11], n=4)
    probe = list(range(3, 40))
    fresh_probe = fresh.probe(probe)
    fresh.close()
    warm = VLLMEngine(a, cfg, 256, seed=0)
    before = warm.generate(PROMPT, [11], n=4)
    before_probe = warm.probe(probe)
    warm.load(b)
    got = warm.generate(PROMPT, [11], n=4)
    got_probe = warm.probe(probe)
    warm.close()
    assert [s.token_ids for s in got[0]] == [s.token_ids for s in want[0]]
    for g, w in zip(got[0], want[0]):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    # and the reload did change something (policy b is not policy a)
    assert [s.logprobs for s in before[0]] != [s.logprobs for s in got[0]]
    # the probe (pipeline.run.sampler_proof): vLLM's prompt logprobs at temperature 1 are the
    # trainer's for the policy it holds, within fp32's limit; before the reload they are policy a's
    with torch.no_grad():
        ref = torch.log_softmax(load_model(b).cpu()(input_ids=torch.tensor([probe])).logits[0, :-1].float(), -1)
    ref = ref.gather(-1, torch.tensor(probe[1:])[:, None])[:, 0]
    assert len(got_probe) == len(probe) - 1
    for p in (fresh_probe, got_probe):
        assert float((torch.tensor(p) - ref).abs().mean()) < 1e-4
    assert float((torch.tensor(before_probe) - ref).abs().mean()) > 1e-2  # policy a: the check tells them apart


def test_vllm_sampler_logprobs_match_the_trainer(two_policies):
    """The sampled tokens' logprobs from vLLM equal the teacher-forced HF logprobs."""
    from pipeline.models.vllm_engine import VLLMEngine

    _, b = two_policies
    cfg = RolloutConfig(max_new_tokens=12, temperature=0.7)
    eng = VLLMEngine(b, cfg, 256, seed=0)
    samples = eng.generate(PROMPT, [5], n=3)[0]
    eng.close()
    model = load_model(b)
    batch = Batch.build(PROMPT * 3, [s.token_ids for s in samples])
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=0.7)
    for i, s in enumerate(samples):
        assert logp[i, : len(s.token_ids)].tolist() == pytest.approx(s.logprobs, abs=2e-4)


@pytest.mark.parametrize("sampler", ["batched", "per_group", "gumbel"])
def test_hf_engine_is_seeded_per_group(two_policies, sampler):
    from pipeline.models.hf_engine import HFEngine

    a, _ = two_policies
    eng = HFEngine(a, RolloutConfig(engine="hf", max_new_tokens=10, hf_sampler=sampler), 256, seed=0)
    one = eng.generate(PROMPT * 2, [1, 2], n=3)
    two = eng.generate(PROMPT, [2], n=3)
    assert [s.token_ids for s in one[1]] == [s.token_ids for s in two[0]]  # batching does not matter
    assert len({tuple(s.token_ids) for s in one[0] + one[1]}) > 1


@pytest.mark.parametrize("sampler", ["batched", "gumbel"])
def test_hf_engine_batched_groups_sample_softmax_over_temperature_from_their_own_seed(two_policies, sampler):
    """The HF engine's one-batch paths (every group of a call in one padded batch, each drawn from
    its own generator): a group's tokens do not depend on the other groups of the call, greedy
    equals the one-group-at-a-time engine, and the recorded logprobs are the trainer's
    log softmax(logits / T) of the sampled tokens."""
    from pipeline.models.hf_engine import HFEngine

    a, _ = two_policies
    cfg = RolloutConfig(engine="hf", max_new_tokens=10, temperature=0.7, hf_sampler="per_group")
    eng = HFEngine(a, cfg, 256, seed=0)
    plain = eng.generate([PROMPT[0], [9, 3]], [1, 2], n=1, greedy=True)
    eng.sampler = sampler
    greedy = eng.generate([PROMPT[0], [9, 3]], [1, 2], n=1, greedy=True)
    assert [[s.token_ids for s in g] for g in greedy] == [[s.token_ids for s in g] for g in plain]
    both = eng.generate([PROMPT[0], [9, 3, 4]], [1, 2], n=3)
    alone = eng.generate([[9, 3, 4]], [2], n=3)
    assert [s.token_ids for s in both[1]] == [s.token_ids for s in alone[0]]
    assert len({tuple(s.token_ids) for s in both[0]}) > 1
    model = load_model(a)
    batch = Batch.build(PROMPT * 3, [s.token_ids for s in both[0]])
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=0.7)
    for i, s in enumerate(both[0]):
        assert logp[i, : len(s.token_ids)].tolist() == pytest.approx(s.logprobs, abs=1e-4)


class _ReferenceGroupDraw:
    """The batched HF engine's draw written out plainly, out of place, as documented: rows come
    `copies` to a group; the group's uniforms come from its own torch.Generator; token =
    argmax(s + Gumbel noise) with s = logits / T truncated by the warpers; its logprob is
    log_softmax(s) at the token. The engine's sampler must match it bit for bit."""

    def __init__(self, seeds, copies, temperature, warpers=()):
        self.gens = [torch.Generator().manual_seed(int(x)) for x in seeds]
        self.copies, self.temperature, self.warpers, self.chosen = copies, temperature, list(warpers), []

    def __call__(self, input_ids, scores):
        s = scores.float() / self.temperature
        for w in self.warpers:
            s = w(input_ids, s)
        u = torch.cat([torch.rand((self.copies, s.shape[-1]), generator=g) for g in self.gens])
        gumbel = -torch.log(-torch.log(u.clamp(min=torch.finfo(torch.float32).tiny)))
        choice = (s + gumbel).argmax(-1)
        self.chosen.append(torch.log_softmax(s, -1).gather(-1, choice[:, None]).squeeze(-1))
        return torch.full_like(s, float("-inf")).scatter(-1, choice[:, None], 0.0)


class _ReferenceCdfDraw(_ReferenceGroupDraw):
    """The default batched draw written out plainly: one float64 uniform u per row from its group's
    own generator; p = softmax(s); the token is the first index whose cumulative sum of p (in
    float64) exceeds u x sum(p) (u x sum kept below the sum); its logprob is log p there."""

    def __call__(self, input_ids, scores):
        s = scores.float() / self.temperature
        for w in self.warpers:
            s = w(input_ids, s)
        u = torch.cat([torch.rand(self.copies, generator=g, dtype=torch.float64) for g in self.gens])
        p = torch.softmax(s, -1)
        cdf = torch.cumsum(p.double(), -1)
        total = cdf[:, -1]
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        choice = torch.tensor([int((row > t).nonzero()[0]) for row, t in zip(cdf, target)])
        self.chosen.append(torch.log(p.gather(-1, choice[:, None]).squeeze(-1)))
        return torch.full_like(s, float("-inf")).scatter(-1, choice[:, None], 0.0)


@pytest.mark.parametrize("draw", ["gumbel", "batched"])
@pytest.mark.parametrize("trunc", [{}, {"top_k": 50, "top_p": 0.9}])
def test_hf_engine_group_sampler_draws_what_the_plain_reference_draws_bit_for_bit(trunc, draw):
    """The sampler's in-place, buffer-reusing form (fewer passes over the vocabulary) changes no
    token and no logprob bit against the plain reference of its draw, step after step, with and
    without top-k / top-p, and leaves `generate`'s scores as it got them."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    from pipeline.models.hf_engine import GroupSampler

    cfg = RolloutConfig(engine="hf", temperature=0.7, **trunc)
    seeds, copies, V = [11, 5, 2026], 4, 3001
    ours = GroupSampler(cfg, False, seeds, copies, torch.device("cpu"), draw=draw)
    warpers = [TopKLogitsWarper(50), TopPLogitsWarper(0.9)] if trunc else []
    ref = (_ReferenceGroupDraw if draw == "gumbel" else _ReferenceCdfDraw)(seeds, copies, 0.7, warpers)
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros((len(seeds) * copies, 1), dtype=torch.long)
    for _ in range(6):
        scores = 4 * torch.randn((len(seeds) * copies, V), generator=g)
        kept = scores.clone()
        got, want = ours(ids, scores), ref(ids, scores.clone())
        assert torch.equal(scores, kept)
        assert torch.equal(got, want)  # -inf but at the same token in every row
        assert torch.equal(ours.chosen[-1], ref.chosen[-1])
        ids = torch.cat([ids, got.argmax(-1, keepdim=True)], 1)
    assert len({tuple(r) for r in ids[:copies].tolist()}) > 1  # a group's rows are drawn, not copied


def test_hf_engine_rollouts_equal_the_plain_reference_samplers_bit_for_bit(two_policies):
    """Whole rollouts on both of the HF engine's paths give exactly the tokens and logprobs of the
    plain reference made in this test: the one-group-at-a-time path (the group's seed, transformers'
    own sampler, log softmax of every stacked step's scores) and the batched path (one padded batch,
    the reference Gumbel draw from each group's own generator)."""
    from transformers import LogitsProcessorList

    from pipeline.models.hf_engine import HFEngine, sampling_config

    a, _ = two_policies
    cfg = RolloutConfig(engine="hf", max_new_tokens=12, temperature=0.8, hf_sampler="per_group")
    eng = HFEngine(a, cfg, 256, seed=0)
    prompts, seeds, n = [PROMPT[0], [9, 3, 4]], [7, 8], 3
    plain = eng.generate(prompts, seeds, n=n)
    for ids, seed, group in zip(prompts, seeds, plain):
        torch.manual_seed(seed)
        inp = torch.tensor([ids] * n)
        gen = sampling_config(cfg, False, cfg.max_new_tokens, eng.stop_ids, eng.pad_id)
        with torch.no_grad():
            out = eng.model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=gen)
        new = out.sequences[:, len(ids):]
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # [n, L, V]
        tok_lp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        for j, smp in enumerate(group):
            assert smp.token_ids == new[j, : len(smp.token_ids)].tolist()
            assert smp.logprobs == [float(x) for x in tok_lp[j, : len(smp.token_ids)]]
    draws = {}
    for sampler, reference in (("gumbel", _ReferenceGroupDraw), ("batched", _ReferenceCdfDraw)):
        eng.sampler = sampler
        batched = draws[sampler] = eng.generate(prompts, seeds, n=n)
        width = max(map(len, prompts))
        rows = [ids for ids in prompts for _ in range(n)]
        inp = torch.tensor([[eng.pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        ref = reference(seeds, n, 0.8)
        with torch.no_grad():
            out = eng.model.generate(inp, attention_mask=mask, logits_processor=LogitsProcessorList([ref]),
                                     generation_config=sampling_config(cfg, True, cfg.max_new_tokens, eng.stop_ids, eng.pad_id))
        new, tok_lp = out.sequences[:, width:], torch.stack(ref.chosen, 1)
        for j, smp in enumerate(s for group in batched for s in group):
            assert smp.token_ids == new[j, : len(smp.token_ids)].tolist()
            assert smp.logprobs == [float(x) for x in tok_lp[j, : len(smp.token_ids)]]
        assert len({tuple(s.token_ids) for s in batched[0]}) > 1
    # the three paths are three draws: the same seeds give other tokens on each
    tokens = {k: [[s.token_ids for s in g] for g in v] for k, v in (("per_group", plain), *draws.items())}
    assert len({repr(v) for v in tokens.values()}) == 3


@pytest.mark.parametrize("trunc", [{}, {"top_k": 5}, {"top_p": 0.8}])
def test_hf_engine_batched_draw_is_softmax_over_temperature(trunc):
    """The default draw's tokens follow softmax(logits / T) as truncated: 40,000 rows of one
    fixed score vector, counted against their probabilities by Pearson's chi-square (scipy),
    and never a truncated token."""
    from scipy.stats import chisquare
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    from pipeline.models.hf_engine import GroupSampler

    cfg = RolloutConfig(engine="hf", temperature=0.7, **trunc)
    V, rows = 12, 40_000
    scores = torch.linspace(-3.0, 2.0, V).repeat(rows, 1)
    ours = GroupSampler(cfg, False, [3, 4], rows // 2, torch.device("cpu"), draw="batched")
    chosen = ours(torch.zeros((rows, 1), dtype=torch.long), scores).argmax(-1)
    s = scores[:1] / 0.7
    for w in [TopKLogitsWarper(5)] if "top_k" in trunc else [TopPLogitsWarper(0.8)] if "top_p" in trunc else []:
        s = w(None, s)
    p = torch.softmax(s, -1)[0].double()
    counts = torch.bincount(chosen, minlength=V).double()
    assert counts[p == 0].sum() == 0  # a truncated token is never drawn
    kept = p > 0
    if "top_k" in trunc:
        assert int(kept.sum()) == 5
    assert chisquare(counts[kept].numpy(), (p[kept] / p[kept].sum() * rows).numpy()).pvalue > 1e-3
    # a biased draw fails the same check: the probabilities of one temperature off
    off = torch.softmax(s * 0.7 / 0.8, -1)[0].double() if not trunc else None
    if off is not None:
        assert chisquare(counts.numpy(), (off / off.sum() * rows).numpy()).pvalue < 1e-6


def test_hf_engine_batched_draw_resolves_probabilities_below_float32s_step():
    """The inverse CDF draws a token of p below 2^-24 with probability p, not 0 or a multiple of
    2^-24 (a float32 uniform takes 2^24 values; a float32 cumulative sum near 1 steps by 2^-24;
    at T = 1 most of a 150k vocabulary, ~1e-3 of its mass, lies there). Each row here puts its own
    uniform (its group's generator's, 53 bits) inside a run of 4096 tokens of p = 2^-34 between two
    large ones: the token drawn is the exact inverse CDF's, spread over that run."""
    from pipeline.models.hf_engine import GroupSampler

    seeds, copies, tail = [1, 2, 3], 64, 4096
    u = torch.cat([torch.rand(copies, generator=torch.Generator().manual_seed(x), dtype=torch.float64) for x in seeds])
    width = tail * 2.0 ** -34
    head = (u - width / 2).clamp(min=2.0 ** -10)  # the run's middle at u
    probs = torch.cat([head[:, None], torch.full((len(u), tail), 2.0 ** -34, dtype=torch.float64),
                       (1 - head - width)[:, None].clamp(min=2.0 ** -10)], 1)
    scores = probs.log().float()
    ours = GroupSampler(RolloutConfig(engine="hf"), False, seeds, copies, torch.device("cpu"), draw="batched")
    got = ours(torch.zeros((len(u), 1), dtype=torch.long), scores).argmax(-1)
    p = torch.softmax(scores, -1).double()
    cdf = p.cumsum(-1)
    want = torch.tensor([int((row > x * row[-1]).nonzero()[0]) for row, x in zip(cdf, u)])
    assert got.tolist() == want.tolist()
    in_run = (want >= 1) & (want <= tail)
    assert int(in_run.sum()) > len(u) // 2 and len(set(want[in_run].tolist())) > len(u) // 3
    assert torch.isfinite(ours.chosen[-1]).all()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_sleeping_engine_gives_kv_cache_and_weights_back_and_wakes_to_the_same_samples(two_policies):
    """`iterate` lets the idle engine sleep while it trains: its KV cache and weights go back
    to the OS. A generate wakes it with the weights it had, a load with new ones, and either
    samples exactly what an engine that never slept samples."""
    from pipeline.models.engine_memory import kv_cache_bytes
    from pipeline.models.vllm_engine import VLLMEngine

    a, b = two_policies
    cfg = RolloutConfig(max_new_tokens=12, kv_cache_gib=0.5)
    eng = VLLMEngine(a, cfg, 256, seed=0)
    try:
        want_a = eng.generate(PROMPT, [3], n=4)
        eng.load(b)
        want_b = eng.generate(PROMPT, [3], n=4)
        before = _rss_mb()
        eng.sleep()
        freed = before - _rss_mb()
        asleep = eng.llm.collective_rpc(_weight_bytes)
        eng.sleep()  # idempotent
        got_b = eng.generate(PROMPT, [3], n=4)  # woken with the weights it had (policy b)
        eng.sleep()
        eng.load(a)  # new weights while asleep
        got_a = eng.generate(PROMPT, [3], n=4)
        awake = eng.llm.collective_rpc(_weight_bytes)
        # the conformance case sampler-gets-new-weights (TRL #5312) on this engine: sleep, sync b -> a, wake
        from pipeline.conformance import engine as conformance
        from pipeline.conformance.case import run_case

        conformance.use_sampler(eng, b, a)
        row = run_case(next(c for c in conformance.cases() if c.id == "sampler-gets-new-weights"), with_trl=False)
    finally:
        eng.close()
    assert row.grpo.holds is True, row.grpo.measured
    assert row.flagged, row.broken.measured  # the engine left on the old weights is caught
    weight_mb = sum(f.stat().st_size for f in b.glob("*.safetensors")) / 2**20  # fp32, as the engine holds them
    assert asleep == [(0, 0)] and awake[0][0] > 0 and awake[0][1] > 0  # no parameter bytes, no packed GEMM
    assert freed > 0.9 * (kv_cache_bytes(cfg, a, 256, "float32") / 2**20 + weight_mb)  # 512 MiB and the weights
    for got, want in ((got_a, want_a), (got_b, want_b)):
        for g, w in zip(got[0], want[0]):
            assert g.token_ids == w.token_ids and g.logprobs == w.logprobs
    assert [s.logprobs for s in want_a[0]] != [s.logprobs for s in want_b[0]]


def _weight_bytes(worker) -> tuple[int, int]:
    """The engine model's parameter bytes, and how many linears hold a packed GEMM."""
    model = worker.get_model()
    return (sum(p.untyped_storage().nbytes() for p in model.parameters()),
            sum(getattr(m, "cpu_linear", None) is not None for m in model.modules()))


def _stored_names(policy) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in policy.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            names.update(st.keys())
    return names


def test_weights_handed_over_from_memory_sample_like_a_reload_from_disk(two_policies, tmp_path):
    """rollout.weight_sync memory: a sleeping engine given policy b's tensors from a model in
    this process (as `iterate` hands it the trainer's) samples exactly what it samples after
    reading b's stored directory, and then holds b's directory as its model. That directory is
    `iterate`'s policy K+1, whose weights file is still being written in the background: after the
    next sleep the engine's wake reloads the weights from it, and waits for the write first
    (the wait `policy_engine` hands a run's engine when it makes it)."""
    import threading

    from transformers import AutoModelForCausalLM

    from pipeline.models.vllm_engine import VLLMEngine
    from pipeline.run import inflight

    a, b = two_policies
    module = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    names = _stored_names(b)
    weights = [(n, t.detach()) for n, t in module.state_dict().items() if n in names]
    assert {n for n, _ in weights} == names
    root = tmp_path / "run"
    policy = root / "policy/iter-0001"  # b, its weights file not written yet
    shutil.copytree(b, policy, ignore=shutil.ignore_patterns("*.safetensors"))
    release = threading.Event()

    def write(p) -> None:
        assert release.wait(300)
        for f in b.glob("*.safetensors"):
            shutil.copy(f, policy / f.name)

    eng = VLLMEngine(a, RolloutConfig(max_new_tokens=12), 256, seed=0, files_ready=inflight.wait_dir)  # as policy_engine makes it
    try:
        from_a = eng.generate(PROMPT, [7], n=4)
        eng.load(b)
        from_disk = eng.generate(PROMPT, [7], n=4)
        eng.load(a)
        eng.sleep()  # as in `iterate`: the new policy reaches an engine asleep since the rollout
        inflight.start(str(root), 1, write)
        eng.load(policy, weights=weights)  # from memory: nothing waits for the file
        held = eng.model_dir
        from_memory = eng.generate(PROMPT, [7], n=4)
        eng.sleep()
        threading.Timer(2.0, release.set).start()  # the write ends after the wake began to reload
        woken = eng.generate(PROMPT, [7], n=4)
    finally:
        release.set()
        eng.close()
    assert held == policy and inflight.get(str(root), 1) is None
    for got in (from_memory, woken):
        for m, d in zip(got[0], from_disk[0]):
            assert m.token_ids == d.token_ids and m.logprobs == d.logprobs
    assert [s.logprobs for s in from_a[0]] != [s.logprobs for s in from_disk[0]]


def test_hf_engine_takes_weights_from_memory_like_from_disk(two_policies):
    from transformers import AutoModelForCausalLM

    from pipeline.models.hf_engine import HFEngine

    a, b = two_policies
    module = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    weights = [(n, t.detach()) for n, t in module.state_dict().items() if n in _stored_names(b)]
    cfg = RolloutConfig(engine="hf", max_new_tokens=10)
    disk, memory = HFEngine(a, cfg, 256, seed=0), HFEngine(a, cfg, 256, seed=0)
    disk.load(b)
    memory.load(b, weights=weights)
    assert memory.model_dir == b
    got, want = memory.generate(PROMPT, [4], n=3), disk.generate(PROMPT, [4], n=3)
    assert [s.token_ids for s in got[0]] == [s.token_ids for s in want[0]]
    assert [s.logprobs for s in got[0]] == [s.logprobs for s in want[0]]
