"""No network at run time: HF_HUB_OFFLINE=1 holds for the whole run, so any hub access fails."""

import os

import pytest


def test_offline_mode_is_set_for_the_run():
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_hub_download_fails_instead_of_reaching_the_network():
    from huggingface_hub import hf_hub_download

    with pytest.raises(Exception, match="(?i)offline|cannot find|not found|connection"):
        hf_hub_download("google/gemma-4-E4B-it", "config.json", cache_dir="/nonexistent-stackcheck-cache")


def test_from_pretrained_of_a_hub_id_fails():
    from transformers import AutoConfig

    with pytest.raises(OSError):
        AutoConfig.from_pretrained("google/gemma-4-E4B-it", cache_dir="/nonexistent-stackcheck-cache")
