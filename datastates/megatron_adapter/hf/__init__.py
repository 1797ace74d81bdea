"""Universal checkpoints <-> Hugging Face GPT-2 or Llama (safetensors + config.json):

  exporter.py       universal -> Hugging Face (`export_hf`, `tools/convert_checkpoint.py to-hf`)
  importer.py       Hugging Face -> universal (`import_hf`, `... from-hf`), never unpickling
  common.py         the one mapping both read: `Rule`, `Layout`, `Plan`
  llama.py, gpt2.py that mapping for each architecture
"""
