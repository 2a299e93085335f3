"""A Hugging Face ``transformers`` Llama decoding greedily with a static KV cache, recorded and
replayed by ``replay`` through its generic path only (see README.md)."""
