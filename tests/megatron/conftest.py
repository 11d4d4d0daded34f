import pytest

from megatron_marsrl.megatron.tiny import make_hf_checkpoint


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """family -> directory of a tiny random HF checkpoint (made once per session)."""
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = str(make_hf_checkpoint(family, tmp_path_factory.mktemp(family)))
        return made[family]

    return get
