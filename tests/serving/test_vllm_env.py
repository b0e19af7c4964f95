"""What the vLLM child process is given: never abplat's own settings (with a risky flag
allowed, the engine runs a model's code)."""

from __future__ import annotations

import dataclasses

from serving import vllm


@dataclasses.dataclass
class Child:
    proc: object = None


def test_the_engine_gets_no_abplat_or_django_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("ABPLAT_DATABASE_URL", "postgres://abplat:s3cret@db/abplat")
    monkeypatch.setenv("ABPLAT_SECRET_KEY", "k" * 60)
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "abplat.settings")
    monkeypatch.setenv("PATH_FOR_TEST", "kept")
    seen = {}

    def start(argv, url, *, env, **kwargs):
        seen.update(env)
        return Child()

    monkeypatch.setattr(vllm.children, "start", start)
    vllm.start(
        ["vllm"],
        "m",
        8001,
        engine_args={},
        served_model_name="m",
        log_path=tmp_path / "v.log",
        env={"EXTRA": "1"},
    )
    assert not [k for k in seen if k.startswith(("ABPLAT_", "DJANGO_"))]
    assert "s3cret" not in repr(seen)
    assert seen["PATH_FOR_TEST"] == "kept" and seen["EXTRA"] == "1" and seen["HF_HUB_OFFLINE"] == "1"
