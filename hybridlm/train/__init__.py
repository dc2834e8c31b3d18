"""Training: `hybridlm train` / `python -m hybridlm.train` (also under torchrun, with FSDP2 on several GPUs).

Modules: data (corpus, documents, packing with cu_seqlens), presets (run settings of the model presets), optim
(AdamW groups, schedule), checkpoint (atomic save / exact resume), parallel (torch.distributed, FSDP2, DCP),
settings (the flags and their checks), run_folder (the lock of --out, continuing a run, --fresh, metrics.jsonl),
signals (SIGINT / SIGTERM), step (a step's forward calls, evaluation, sampling), trainer (the loop and its state),
main (the job, in order). Tokenizers and model shapes are the model's (hybridlm.model.tokenizer, .presets).
"""
