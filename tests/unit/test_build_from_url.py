"""``data.build_from`` as a URL (the shakespeare-char recipe's tinyshakespeare): downloaded once
into the dataset's folder, then built from there. Served here by a local HTTP server, so the
real download code runs without the internet."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import pytest

from megatron_lite.config import load_config
from megatron_lite.data.build import ensure_dataset
from megatron_lite.data.indexed import IndexedDataset
from tests.conftest import REPO

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50


@pytest.fixture()
def server(tmp_path):
    """(base URL, the list of paths requested) of a server of ``tmp_path/site``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "input.txt").write_text(TEXT)
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

        def do_GET(self):
            if self.path != "/cut.txt":
                return super().do_GET()
            # A connection that ends early: the length promised, a fifth of it sent.
            self.send_response(200)
            self.send_header("Content-Length", str(len(TEXT)))
            self.end_headers()
            self.wfile.write(TEXT[: len(TEXT) // 5].encode())
            self.close_connection = True

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    httpd.shutdown()


def _data(tmp_path: Path, build_from: str):
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [
        f"data.prefix={tmp_path}/built/tiny_text_document", f"data.build_from={build_from}",
        f"data.tokenizer.model={tmp_path}/built/chars.json"])
    return cfg.data


def test_the_recipe_downloads_tinyshakespeare_once_and_builds_from_it(tmp_path, server):
    url, requests = server
    recipe = load_config(REPO / "recipes/shakespeare-char.yaml", []).data.build_from
    assert recipe.startswith("https://") and recipe.endswith("/input.txt")
    data = _data(tmp_path, f"{url}/input.txt")
    said: list[str] = []
    ensure_dataset(data, log=said.append)
    assert (tmp_path / "built/input.txt").read_text() == TEXT
    assert not list((tmp_path / "built").glob(".*.part"))
    assert IndexedDataset(data.prefix).n_tokens == len(TEXT)
    assert said[0] == f"downloading {url}/input.txt to {tmp_path}/built/input.txt"
    # Built again (the dataset removed): the downloaded text is reused, not fetched again.
    for suffix in (".bin", ".idx"):
        Path(data.prefix + suffix).unlink()
    ensure_dataset(data, log=said.append)
    assert requests == ["/input.txt"]


def test_a_failed_download_names_the_url_and_leaves_nothing(tmp_path, server):
    url, _ = server
    data = _data(tmp_path, f"{url}/missing.txt")
    with pytest.raises(FileNotFoundError) as e:
        ensure_dataset(data, log=lambda m: None)
    message = str(e.value)
    assert f"downloading {url}/missing.txt failed (HTTP Error 404" in message
    assert "set data.build_from=PATH" in message
    assert sorted(p.name for p in (tmp_path / "built").iterdir()) == []


def test_a_download_cut_short_is_refused_not_built_from(tmp_path, server):
    url, _ = server
    data = _data(tmp_path, f"{url}/cut.txt")
    with pytest.raises(FileNotFoundError) as e:
        ensure_dataset(data, log=lambda m: None)
    assert f"downloading {url}/cut.txt failed (" in str(e.value)
    assert "set data.build_from=PATH" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "built").iterdir()) == []
