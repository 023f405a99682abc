"""A web page cannot drive the API (issue 44, finding 6). Without a key (the `make serve` default) any page the user
visits could POST to a loopback API: a `text/plain` body needs no CORS preflight, and DNS rebinding lets a page
read the answers under its own domain name. So: JSON only as application/json (415), multipart only as multipart;
a request whose Origin is not named by --cors-origin is 403 (named ones get CORS answers); a Host other than the
bind address, loopback's names or --allowed-hosts is 403 — on `openai-api` and `serve --openai-port` alike.

Over the real API and the real openai client (whose Host is its URL's and whose bodies are application/json and
multipart); Triton is the stand-in of conftest.py, which counts what reaches it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from trt_diffusion import api as api_module
from trt_diffusion.cli import main
from trt_diffusion.errors import ServeError
from trt_diffusion.openai_api.server import ApiServer
from trt_diffusion.openai_api.settings import ApiSettings

GUARD_S = 20
ORIGIN = "https://app.example.com"


@pytest.fixture
def api(stub_triton):
    settings = ApiSettings(stub_triton.url, port=0, allowed_hosts=("images.example.com",), cors_origins=(ORIGIN,))
    with ApiServer(settings) as server:
        yield server


def call(api, path: str, body: bytes | None = None, method: str | None = None, **headers) -> tuple[int, dict, dict]:
    headers = {name.replace("_", "-"): value for name, value in headers.items()}
    request = urllib.request.Request(api.url.removesuffix("/v1") + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=GUARD_S) as response:
            raw, status, answer_headers = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as err:
        raw, status, answer_headers = err.read(), err.code, dict(err.headers)
    return status, (json.loads(raw) if raw else {}), {k.lower(): v for k, v in answer_headers.items()}


GENERATION = json.dumps({"prompt": "a fox"}).encode()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None,
                                          "multipart/form-data; boundary=x"])
def test_json_only_as_application_json(api, stub_triton, content_type):
    headers = {} if content_type is None else {"Content_Type": content_type}
    status, body, _ = call(api, "/v1/images/generations", GENERATION, **headers)
    assert status == 415, body
    assert body["error"]["message"].startswith("/v1/images/generations takes application/json, got ")
    assert stub_triton.calls["ModelInfer"] == 0
    # application/json, with or without parameters, is read (and reaches the stand-in Triton)
    for kind in ("application/json", "Application/JSON; charset=utf-8"):
        assert "stub triton" in call(api, "/v1/images/generations", GENERATION, Content_Type=kind)[1]["error"][
            "message"]


def test_multipart_only_as_multipart(api):
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        status, body, _ = call(api, "/v1/images/edits", b"prompt=a", Content_Type=kind)
        assert status == 415 and "takes multipart/form-data" in body["error"]["message"], body
    # or as JSON (OpenAI's JSON form of an edit), which a page can send only after a CORS preflight
    status, body, _ = call(api, "/v1/images/edits", b"prompt=a", Content_Type="application/json")
    assert status == 400 and body["error"]["message"].startswith("the body is not JSON"), body


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://app.example.com",
                                    "https://app.example.com:8443"])
def test_an_origin_not_named_by_cors_origin_is_403(api, stub_triton, origin):
    status, body, headers = call(api, "/v1/images/generations", GENERATION, Content_Type="application/json",
                                 Origin=origin)
    assert status == 403 and body["error"]["code"] == "origin_not_allowed", body
    assert f"Origin {origin!r} may not call this API" in body["error"]["message"]
    assert "access-control-allow-origin" not in headers
    assert call(api, "/v1/models", Origin=origin)[0] == 403  # reading too (a rebinding page's goal)
    status, _, headers = call(api, "/v1/images/generations", method="OPTIONS", Origin=origin,
                              Access_Control_Request_Method="POST")
    assert status == 403 and "access-control-allow-origin" not in headers
    assert stub_triton.calls["ModelInfer"] == 0


def test_a_named_origin_gets_cors_answers(api):
    status, _, headers = call(api, "/v1/images/generations", method="OPTIONS", Origin=ORIGIN,
                              Access_Control_Request_Method="POST",
                              Access_Control_Request_Headers="authorization, content-type")
    assert status == 204
    assert headers["access-control-allow-origin"] == ORIGIN and "POST" in headers["access-control-allow-methods"]
    assert "content-type" in headers["access-control-allow-headers"]
    status, body, headers = call(api, "/v1/models", Origin=ORIGIN)
    assert status == 200 and body["data"][0]["id"] == "sd15-tiny"
    assert headers["access-control-allow-origin"] == ORIGIN and headers["vary"] == "Origin"


@pytest.mark.parametrize("host, allowed", [
    ("evil.example", False), ("evil.example:8080", False), ("127.0.0.1.evil.example", False),
    ("localhost.evil.example", False), ("images.example.com.evil", False), ("0.0.0.0", False),
    ("localhost", True), ("LOCALHOST:8080", True), ("127.0.0.1:1234", True), ("[::1]:8080", True),
    ("images.example.com", True), ("Images.Example.Com:443", True),
])
def test_host_must_name_this_server(api, host, allowed):
    status, body, _ = call(api, "/health", Host=host)
    if allowed:
        assert status == 200 and body["status"] == "ok", body
    else:
        assert status == 403 and body["error"]["code"] == "host_not_allowed", body
        assert f"Host {host!r} is not this server's name" in body["error"]["message"]
        assert "--allowed-hosts" in body["error"]["message"]


def test_the_bind_address_is_a_host_name_a_wildcard_is_not():
    assert "10.1.2.3" in ApiSettings("127.0.0.1:8001", host="10.1.2.3").host_names()
    names = ApiSettings("127.0.0.1:8001", host="0.0.0.0", allowed_hosts=("[2001:db8::1]",)).host_names()
    assert names == {"localhost", "127.0.0.1", "::1", "2001:db8::1"}


def test_the_openai_client_passes_the_guards(api):
    import openai

    client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=GUARD_S)
    assert [model.id for model in client.models.list()] == ["sd15-tiny"]
    with pytest.raises(openai.NotFoundError, match="model 'nope' is not served"):
        client.images.generate(model="nope", prompt="a fox")
    with pytest.raises(openai.BadRequestError, match="stub triton: no engine here"):  # JSON read, sent on
        client.images.generate(model="sd15-tiny", prompt="a fox")


@pytest.mark.parametrize("settings, words", [
    (dict(cors_origins=("*",)), "--cors-origin '*' is not a web origin"),
    (dict(cors_origins=("https://app.example.com/path",)), "--cors-origin 'https://app.example.com/path'"),
    (dict(cors_origins=("app.example.com",)), "--cors-origin 'app.example.com' is not a web origin"),
    (dict(allowed_hosts=("*",)), "--allowed-hosts '*' is not a host name"),
    (dict(allowed_hosts=("https://images.example.com",)), "--allowed-hosts 'https://images.example.com'"),
    (dict(allowed_hosts=("images.example.com:8080",)), "give the host without its port"),
    (dict(allowed_hosts=("[::1]:8080",)), "give the host without its port"),  # never matched a Host header
])
def test_bad_guard_settings_are_refused_by_name(settings, words):
    with pytest.raises(ServeError, match=None) as caught:
        ApiSettings("127.0.0.1:8001", **settings).check()
    assert words in str(caught.value)


def run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def test_both_cli_paths_take_the_guard_options(monkeypatch, capsys):
    started = {}
    monkeypatch.setattr(api_module, "openai_api", lambda settings: started.setdefault("openai-api", settings))
    monkeypatch.setattr(api_module, "serve", lambda repo, **options: started.setdefault("serve", options))
    guard_options = ["--allowed-hosts", "images.example.com,gpu-box", "--allowed-hosts", "10.0.0.7",
                     "--cors-origin", ORIGIN]
    assert run(["openai-api", *guard_options], capsys)[0] == 0
    assert run(["serve", "--openai-port", "8085", *guard_options], capsys)[0] == 0
    for settings in (started["openai-api"], started["serve"]["openai"]):
        assert settings.allowed_hosts == ("images.example.com", "gpu-box", "10.0.0.7")
        assert settings.cors_origins == (ORIGIN,)


def test_a_wildcard_bind_says_which_names_it_answers(monkeypatch, capsys):
    monkeypatch.setattr(api_module, "openai_api", lambda settings: None)
    code, text = run(["openai-api", "--host", "0.0.0.0"], capsys)
    assert code == 0 and "list the names other clients use with --allowed-hosts" in text, text
    code, text = run(["openai-api", "--host", "0.0.0.0", "--allowed-hosts", "gpu-box"], capsys)
    assert code == 0 and "--allowed-hosts" not in text, text


@pytest.mark.parametrize("argv, words", [
    (["openai-api", "--cors-origin", "*"], "--cors-origin '*' is not a web origin"),
    (["serve", "--openai-port", "8085", "--allowed-hosts", "a.example:80"], "give the host without its port"),
    (["serve", "--cors-origin", ORIGIN], "--allowed-hosts and --cors-origin guard the OpenAI API: give "
                                         "--openai-port too"),
])
def test_bad_guard_options_exit_1_naming_the_option(monkeypatch, capsys, argv, words):
    monkeypatch.setattr(api_module, "openai_api", lambda settings: pytest.fail("started"))
    monkeypatch.setattr(api_module, "serve", lambda repo, **options: pytest.fail("started"))
    code, text = run(argv, capsys)
    assert code == 1 and words in text and "Traceback" not in text, text
