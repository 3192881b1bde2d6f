"""The GRPO objective, one folder: advantages from rewards (NumPy, `advantages`), the policy loss
with its loss types and the KL estimators (`loss`), the sampler-mismatch weight (`correction`)
and the KL-in-reward controllers (`kl`). The trainer only calls them (docs/loss.md)."""
