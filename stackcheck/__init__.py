"""stackcheck: conformance and regression suite for the Hugging Face QLoRA stack."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
