"""The MTP reference engine: a small hybrid LLM with speculative decoding that really drifts.

Modules: `config` (ModelArgs presets, EngineConfig), `engine` (Engine, the decode loop),
`factory` (build_engine, what `replay` re-runs through), `launch` (N ranks, spawned or torchrun),
`graphs` (the bucketed static-buffer / CUDA-graph runner), `tuner`, `collectives`, `tp`, and the
model in `model`, `attention`, `recurrent`, `moe`, `mtp_head`, `norm`. See docs/workloads-mtp.md.

Nothing is imported here, so importing one module does not load the others.
"""
