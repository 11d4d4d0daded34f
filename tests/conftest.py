import pytest

from megatron_marsrl.megatron.tiny import make_hf_checkpoint


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(family, **config overrides) -> directory of a tiny random HF checkpoint (made once)."""
    made = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = str(make_hf_checkpoint(family, tmp_path_factory.mktemp(family), overrides=overrides))
        return made[key]

    return get
