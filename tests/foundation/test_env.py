import pytest

from abplat import env


def test_bool_accepts_known_words(monkeypatch):
    monkeypatch.setenv("X_FLAG", "Yes")
    assert env.env_bool("X_FLAG", False) is True
    monkeypatch.setenv("X_FLAG", "off")
    assert env.env_bool("X_FLAG", True) is False


def test_bool_rejects_maybe_naming_the_variable(monkeypatch):
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(env.EnvError, match="X_FLAG='maybe'"):
        env.env_bool("X_FLAG", False)


def test_url_scheme_checked(monkeypatch):
    monkeypatch.setenv("X_URL", "mysql://h/db")
    with pytest.raises(env.EnvError, match="X_URL.*postgres://"):
        env.env_url("X_URL", "", schemes=("postgres",))
    monkeypatch.setenv("X_URL", "")
    assert env.env_url("X_URL", "postgres://default", schemes=("postgres",)) == ""


def test_endpoints_parsed_and_checked(monkeypatch):
    monkeypatch.setenv("X_EP", "127.0.0.1:2379, etcd-2:2379")
    assert env.env_endpoints("X_EP") == [("127.0.0.1", 2379), ("etcd-2", 2379)]
    monkeypatch.setenv("X_EP", "127.0.0.1")
    with pytest.raises(env.EnvError, match="'127.0.0.1' is not host:port"):
        env.env_endpoints("X_EP")


def test_int_range(monkeypatch):
    monkeypatch.setenv("X_N", "0")
    with pytest.raises(env.EnvError, match=r"\[1, 9\]"):
        env.env_int("X_N", 2, minimum=1, maximum=9)
    monkeypatch.setenv("X_N", "two")
    with pytest.raises(env.EnvError, match="whole number"):
        env.env_int("X_N", 2)
