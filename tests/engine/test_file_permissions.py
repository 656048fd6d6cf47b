"""Folders Pagoda writes are readable by other users (0755 folders, 0644 files), whatever
the umask of whoever wrote them: a model converted (or built into an image) by one user
can be served by another, non-root one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine import default_model


@pytest.fixture
def strict_umask():
    old = os.umask(0o077)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def write_tree(root: Path) -> None:
    (root / "sub" / "deeper").mkdir(parents=True)
    for rel in ("config.json", "model.safetensors", "sub/tokenizer.json", "sub/deeper/x.bin"):
        (root / rel).write_text("{}")
    os.chmod(root / "model.safetensors", 0o600)
    os.chmod(root / "sub" / "deeper", 0o700)


def assert_readable_tree(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        assert mode(Path(dirpath)) == 0o755, dirpath
        for name in filenames:
            assert mode(Path(dirpath) / name) == 0o644, os.path.join(dirpath, name)


def test_make_readable_fixes_a_private_tree(tmp_path, strict_umask):
    root = tmp_path / "model"
    root.mkdir()
    write_tree(root)
    assert mode(root) == 0o700 and mode(root / "config.json") == 0o600  # the umask at work
    default_model.make_readable(root)
    assert_readable_tree(root)


def test_make_readable_leaves_symlink_targets_alone(tmp_path, strict_umask):
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    os.chmod(outside, 0o600)
    root = tmp_path / "model"
    root.mkdir()
    (root / "link").symlink_to(outside)
    default_model.make_readable(root)
    assert mode(outside) == 0o600
    assert mode(root) == 0o755


def test_default_model_conversion_writes_a_readable_folder(tmp_path, monkeypatch, strict_umask):
    """ensure_default_model, with the slow GGUF conversion replaced by a few files."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_text("")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_gguf_path", lambda: gguf)
    monkeypatch.setattr(default_model, "_convert", lambda _gguf, out: write_tree(out))
    target = default_model.ensure_default_model(verbose=False)
    assert target == tmp_path / "cache" / "models" / default_model.DEFAULT_MODEL_NAME
    assert_readable_tree(target)
    # The cache folders it created on the way are 0755 as well.
    assert mode(tmp_path / "cache") == 0o755
    assert mode(tmp_path / "cache" / "models") == 0o755
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".convert-")]
