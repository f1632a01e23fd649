"""Interop with Hugging Face `transformers`: `architectures.py` (which class holds a model: Llama,
Qwen3, Mixtral, Qwen3-MoE; its config.json both ways), `mapping.py` (the weights' names and layouts) and `files.py`
(reading a HF folder to initialise from, writing one on export), `config_json.py` (a class's
config.json both ways) and `tokenizer_files.py` (the export's tokenizer files)."""
