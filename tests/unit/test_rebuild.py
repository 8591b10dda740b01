"""What `verify --rebuild` names when a published image is not what its lock builds (publishing/rebuild.py), on layer
indexes and configs made here (no Docker, no registry)."""

from __future__ import annotations

from skupin.imageview.layers import Entry, LayerIndex
from skupin.publishing.rebuild import Rebuilt, config_difference, first_file_difference


def _layer(**files: Entry) -> LayerIndex:
    index = LayerIndex(diff_id="sha256:x")
    index.entries.update({name.replace("__", "/"): entry for name, entry in files.items()})
    return index


F = Entry("f", 0o644, 3, 100, "a" * 64)


def test_the_first_file_that_differs_is_named_with_what_differs() -> None:
    published = _layer(usr=Entry("d", 0o755, 0, 100), usr__a=F, usr__b=F._replace(sha256="b" * 64))
    rebuilt = _layer(usr=Entry("d", 0o755, 0, 100), usr__a=F, usr__b=F)
    path, how = first_file_difference(published, rebuilt) or ("", "")
    assert path == "usr/b" and "sha256 bbbbbbbbbbbbbbbb" in how and "sha256 aaaaaaaaaaaaaaaa" in how


def test_a_file_only_one_side_has_is_named_and_equal_layers_have_no_difference() -> None:
    assert first_file_difference(_layer(a=F), _layer(a=F, b=F)) == ("b", "published: absent; rebuilt: file, mode 644, "
                                                                      "mtime 100, 3 bytes, sha256 aaaaaaaaaaaaaaaa")
    assert first_file_difference(_layer(a=F), _layer(a=F)) is None
    assert "mode 755" in first_file_difference(_layer(a=F._replace(mode=0o755)), _layer(a=F))[1]  # type: ignore[index]
    opaque = _layer(a=F)
    opaque.opaque.add("etc")
    assert first_file_difference(opaque, _layer(a=F)) == ("etc", "an opaque folder in only the published layer")


def test_config_fields_that_differ_are_named() -> None:
    a = {"created": "2026-12-01T00:00:00Z", "config": {"Env": ["A=1"], "Cmd": ["x"]}, "os": "linux"}
    b = {"created": "2026-12-02T00:00:00Z", "config": {"Env": ["A=2"], "Cmd": ["x"]}, "os": "linux"}
    assert config_difference(a, b) == "the configs differ in created, config.Env"


def test_the_answer_names_the_layer_and_file_and_refuses_with_publish_s_exit_code() -> None:
    bad = Rebuilt(ok=False, ref="r:verified", reference="r@sha256:1", sku="cpu-x86_64", published_digest="sha256:1" * 1,
                  rebuilt_digest="sha256:2", published_image_id="sha256:3", rebuilt_image_id="sha256:4",
                  difference="layer 3 (...): first differing file /usr/b: ...", layer=3, file="usr/b", build_s=90,
                  total_s=120)
    assert "NOT rebuilt to the same image" in bad.line() and "/usr/b" in bad.line()
    assert bad.error().exit_code == 8
    good = bad.model_copy(update={"ok": True, "difference": "", "layer": None, "file": None})
    assert good.line().startswith("rebuilt: r:verified -> r@sha256:1: the lock builds the same image here")
