"""What a checkpoint's config.json says, read without torch: the families' typed configs
(hf_config, deepseek_config, gpt_oss_config, qwen3_next_config), block-scaled FP8's
quantization_config (fp8_config), and `load.load_arch_config`. worker/model builds the model
from them; the launcher and `tandem plan` check a checkpoint with them before any process
starts."""
