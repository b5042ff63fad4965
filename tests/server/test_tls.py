"""`prescient serve` over HTTPS in its own process, its keys from the environment variable (out of the
process list), with a certificate made at test time by trustme: the `openai` client that trusts the
test CA gets completions with either key and a 401 without; a client that does not trust the CA, or
speaks plain HTTP, gets nothing; SIGTERM still ends the server with status 0."""

from __future__ import annotations

import signal
import ssl

import httpx
import openai
import pytest
import trustme

from tests.server.serving import MODEL, free_port, serve_process

KEYS = ("sk-tls-one", "sk-tls-two")


@pytest.mark.slow  # 20-45 s: the default suite must stay under 10 minutes on 2 cores
def test_https_with_keys_from_the_environment(tiny_moe_dir, tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    with serve_process(tiny_moe_dir("mixtral"), port, "--ssl-keyfile", str(key_file), "--ssl-certfile",
                       str(cert_file), env={"PRESCIENT_API_KEY": ",".join(KEYS)}, verify=trusted) as proc:
        assert not any(key in arg for key in KEYS for arg in proc.args)

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60,
                                 http_client=openai.DefaultHttpxClient(verify=trusted))

        for key in KEYS:
            answer = client(key).completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0)
            assert answer.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            client("sk-wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health")  # the system's CAs do not know the test CA
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "Traceback" not in proc.stdout.read()
