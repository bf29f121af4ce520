"""The web page's files as the server sends them (the page itself is tested in a real browser in
test_ui_browser.py): where they are, with which headers, and that they need no key."""

from __future__ import annotations

import re
import time

from server.routes.ui import UI_DIR


def test_root_sends_you_to_the_page(make_client):
    client = make_client(api_key="secret")
    response = client.get("/", follow_redirects=False)
    assert response.status_code == 307 and response.headers["location"] == "/ui/"


def test_page_files_need_no_key_and_carry_a_strict_policy(make_client):
    client = make_client(api_key="secret")
    page = client.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    script = client.get("/ui/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert client.get("/v1/sessions").status_code == 401  # the data behind the page still needs the key


def test_every_file_the_page_names_is_served(make_client):
    """index.html and the modules name each other; a missing file would only show in a browser.
    Each is sent at once: no wait (here up to 5 s) for a body a GET does not have."""
    client = make_client(body_read_timeout_seconds=30)
    started = time.monotonic()
    page = client.get("/ui/").text
    names = set(re.findall(r'(?:href|src)="([\w.]+)"', page))
    for module in UI_DIR.glob("*.js"):
        names |= set(re.findall(r'from "\./([\w.]+)"', module.read_text()))
    assert {"app.js", "style.css", "api.js", "texts.js", "viewer.js"} <= names
    for name in names:
        assert client.get(f"/ui/{name}").status_code == 200, name
    assert time.monotonic() - started < 4.0, "the files waited"


def test_no_path_outside_the_page_folder(client):
    # percent-encoded, so the client sends the dots as they are and the static files decode them
    response = client.get("/ui/%2e%2e/routes/ui.py")
    assert response.status_code == 404 and "PageFiles" not in response.text
