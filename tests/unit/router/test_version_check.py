import pytest

from lora_core.errors import AdapterVersionUnavailable
from lora_core.identity import AdapterRef
from replica.serve_protocol import check_version


def ref(version):
    return AdapterRef("t", version, "c" * 64, "/p", 8)


def test_newer_and_equal_versions_pass_and_are_recorded():
    newest = {}
    check_version(ref(1), newest)
    assert newest == {"t": 1}
    check_version(ref(2), newest)
    check_version(ref(2), newest)
    assert newest == {"t": 2}


def test_an_older_version_is_refused_retryably():
    newest = {"t": 3}
    with pytest.raises(AdapterVersionUnavailable) as e:
        check_version(ref(2), newest)
    assert e.value.retryable
    assert "version 2 was replaced by version 3" in str(e.value)
    assert newest == {"t": 3}
