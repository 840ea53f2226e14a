"""Model loading: GGUF files, their quantized tensors, tokenizers and chat templates."""
