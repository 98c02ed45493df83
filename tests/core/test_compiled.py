"""The compiled engine model: built by the install, and refused once its source has changed."""

import hashlib
import json
import os
from pathlib import Path

import pytest

import disagg.core.engine_model as engine_model
from disagg.core.compiled import DIGESTS, StaleBuild, check_compiled_sources, stale_sources


def test_the_install_built_the_engine_model_as_an_extension():
    # DISAGG_NO_COMPILE=1 is the documented way to install without a C compiler: only then is it pure
    compiled = Path(engine_model.__file__).suffix in (".so", ".pyd")
    assert compiled == (os.environ.get("DISAGG_NO_COMPILE", "") in ("", "0")), engine_model.__file__


def test_the_installed_digest_is_the_source_beside_it():
    if not DIGESTS.exists():  # a pure install records none
        assert Path(engine_model.__file__).suffix == ".py"
        return
    digests = json.loads(DIGESTS.read_text())
    source = Path(engine_model.__file__).with_name("engine_model.py")
    assert digests["engine_model.py"] == hashlib.sha256(source.read_bytes()).hexdigest()
    check_compiled_sources()  # and the import-time check agrees


def _build(tmp_path: Path, source_text: str, *, extension: bool = True) -> Path:
    (tmp_path / "engine_model.py").write_text(source_text)
    digest = hashlib.sha256(source_text.encode()).hexdigest()
    (tmp_path / DIGESTS.name).write_text(json.dumps({"engine_model.py": digest}))
    if extension:
        (tmp_path / "engine_model.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    return tmp_path


def test_an_extension_built_from_the_source_beside_it_is_not_stale(tmp_path):
    assert stale_sources(_build(tmp_path, "x = 1\n")) == []


def test_an_extension_older_than_an_edit_of_its_source_is_stale(tmp_path):
    d = _build(tmp_path, "x = 1\n")
    (d / "engine_model.py").write_text("x = 2\n")
    assert stale_sources(d) == ["engine_model.py"]


def test_a_source_with_no_extension_beside_it_runs_as_it_is(tmp_path):
    d = _build(tmp_path, "x = 1\n", extension=False)
    (d / "engine_model.py").write_text("x = 2\n")
    assert stale_sources(d) == []


def test_the_stale_build_error_names_the_source_and_the_rebuild(tmp_path):
    d = _build(tmp_path, "x = 1\n")
    (d / "engine_model.py").write_text("x = 2\n")
    with pytest.raises(StaleBuild, match=r"engine_model\.py changed since it was compiled.*make install"):
        check_compiled_sources(d)
