"""Training: `hybridlm train` / `python -m hybridlm.train` (also under torchrun, with FSDP2 on several GPUs).

Modules: data (corpus, documents, packing with cu_seqlens), presets (run settings of the model presets), optim
(AdamW groups, schedule), checkpoint (atomic save / exact resume), parallel (torch.distributed, FSDP2, DCP), main
(the CLI and the loop). Tokenizers and model shapes are the model's (hybridlm.model.tokenizer, .presets).
"""
