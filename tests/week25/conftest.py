"""Issue 38's fixtures: a second tiny random checkpoint, with other weights than the bundled tiny
model's, to serve beside it (the server itself: agents_helpers.py)."""

import pytest

from nanoserve.testing import make_checkpoint, tiny_config


@pytest.fixture(scope="session")
def other_model(tmp_path_factory) -> str:
    """A second tiny checkpoint (the bundled tokenizer, other weights): its answers differ from tiny's."""
    path, _ = make_checkpoint(tmp_path_factory.mktemp("other-model"), tiny_config(), seed=7)
    return str(path)
