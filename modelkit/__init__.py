"""Making models for the engine to serve: the presets `pdserve make-model` builds (`make_model`),
the project's byte-level BPE tokenizer (`bpe_tokenizer`) and the CPU trainer of the small
DeepSeek-V3 + MTP model (`training`, `pdserve train-tiny`; needs the `train` extra).

Nothing in `engine/` imports this package: the engine only reads HF-format model folders.
"""
