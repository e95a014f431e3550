"""A model's files: path resolution, GGUF metadata, tokenizer and chat template; shared by frontend and engines."""
