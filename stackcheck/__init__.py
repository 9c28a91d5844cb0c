"""stackcheck: conformance and regression suite for the Hugging Face QLoRA stack."""
