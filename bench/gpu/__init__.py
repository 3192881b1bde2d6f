"""The GPU proof, prepared on a CPU so a lent GPU's minutes go to the proof (docs/gpu.md):
`python -m bench.gpu pack` (the wheels the GPU machine lacks, a slimmed vLLM among them, in parts of one
device call each), `dry-run` (the proof at a small size in a Python 3.12 virtualenv holding only the GPU
machine's packages, the pack brought part by part as the device calls bring it), `report DIR` (the figures that came
back, into bench/results.md and docs/gpu.md); `bash bench/gpu/run.sh` is the command each device call runs there."""
