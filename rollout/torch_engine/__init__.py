"""The CPU torch engine: an HF causal LM behind SGLang's native HTTP API."""
