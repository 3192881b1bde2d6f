"""The demo's sizes, in a module without torch so `grpo --help` stays instant."""

N_TRAIN = 4000
"""Training problems `grpo make-data` writes."""
SFT_STEPS, SFT_LR, SFT_BATCH = 500, 1e-3, 16
"""The supervised warm start: steps, learning rate, batch size."""
