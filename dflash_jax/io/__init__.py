"""Files in and out: HF / z-lab safetensors checkpoints, Orbax drafter checkpoints, tokenizers and
chat templates, JSONL, YAML configs."""
