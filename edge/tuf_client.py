"""The agent's TUF client (``pull --tuf URL --tuf-root ROOT.json``): the same :class:`BundleRef` the MLflow client
yields, from a TUF repository written by ``sim2edge publish`` (registry/tuf_repo.py documents its layout).

``tuf``'s ``ngclient`` refreshes root → timestamp → snapshot → targets from ``<URL>/metadata/`` and refuses
expired metadata (freeze), a version lower than the one it last trusted (rollback), a snapshot or targets file
other than the one the signed metadata above it names (mix-and-match), bad signatures, and a target whose
length or sha256 differ from the signed ``targets.json`` (tampering, endless data). The trusted metadata lives
in ``<store>/tuf/<sha256 of URL, 16 hex>/``; ``--tuf-root`` seeds it on first use only (a rotated root that
was verified later stays trusted).

While a staged rollout is under way, ``<policy>`` alone follows the signed ``<policy>/rollout.json`` instead
(edge/rollout_plan.py): the version of the device's ring, found from ``--device-id`` and ``--label``.

A target's ``custom.sim2edge`` fields (policy, version, target, bundle_sha256) are parsed here like the
registry's tags: the policy and version must be the ones asked for (``<policy>`` alone means the target
``<policy>/latest.tar``) and ``bundle_sha256`` must equal the signed sha256; the bundle's own signed
manifest is then checked against them by the same verification as an MLflow pull (edge/pull.py).

Refusals are ``CheckFailed("tuf", "<TUF error class>: …")``; an unreachable repository or an HTTP error is
:class:`RegistryUnavailable` (check ``tuf``), counted in the pull backoff. Works with ``tuf`` 5.1 (CPython
3.8/3.9) and 7.x (whose ``Updater`` takes a keyword ``bootstrap``; ``None`` there means the cached root, as 5.1).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import shutil
import urllib.parse
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

from edge.errors import CheckFailed, RegistryUnavailable
from edge.registry_answers import BundleRef
from edge.registry_client import DownloadStats, TransferOptions
from edge.rollout_plan import MAX_BYTES as MAX_PLAN_BYTES
from edge.rollout_plan import parse_plan, ring_of, version_for
from edge.store import DeviceStore
from edge.values import ArtifactPath, PolicyName, Sha256, Version, shown

CUSTOM = "sim2edge"


def parse_tuf_ref(ref: str) -> Tuple[PolicyName, Optional[Version]]:
    """``<policy>`` (its latest published version) or ``<policy>@<version>``."""
    policy, sep, version = ref.partition("@")
    try:
        name = PolicyName.parse(policy, check="reference")
        return name, Version.parse(version, check="reference") if sep else None
    except CheckFailed as e:
        raise ValueError(f"TUF reference {shown(ref)} must look like <policy> or <policy>@<version> "
                         f"(a TUF repository names versions, not aliases): {e.detail}") from None


@contextlib.contextmanager
def tuf_errors(url: str) -> Iterator[None]:
    """TUF's exceptions as the agent's: refused (check ``tuf``) or unavailable."""
    from tuf.api import exceptions as tx

    try:
        yield
    except (tx.RepositoryError, tx.DownloadLengthMismatchError) as e:
        raise CheckFailed("tuf", f"{type(e).__name__}: {' '.join(str(e).split())} (repository {url})") from None
    except tx.DownloadError as e:
        cause = e.__cause__ or e.__context__
        detail = f"{e}" + (f" ({cause})" if cause else "")
        raise RegistryUnavailable(f"repository {url} unavailable: {type(e).__name__}: {' '.join(detail.split())}",
                                  "tuf") from None


class TufClient:
    """``resolve`` and ``download`` as :class:`edge.registry_client.RegistryClient` has them, through TUF."""

    def __init__(self, url: str, trusted_root: Path, store: DeviceStore,
                 options: Optional[TransferOptions] = None, device_id: str = "",
                 labels: Optional[Dict[str, str]] = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname or parts.username or parts.password:
            raise ValueError(f"TUF repository URL {shown(url)} must be http(s)://host[:port][/path], no credentials")
        self.url = url.rstrip("/")
        self.trusted_root = trusted_root
        self.store = store
        self.options = options or TransferOptions()
        self.device_id = device_id
        self.labels = labels or {}
        self._infos: Dict[str, object] = {}
        self._updater = None

    @property
    def _key(self) -> str:
        """This repository's folder name under ``<store>/tuf/``: the URL's sha256, 16 hex."""
        return hashlib.sha256(self.url.encode()).hexdigest()[:16]

    def _open(self):
        """The refreshed ``Updater`` (made on first use, under the caller's store lock)."""
        if self._updater is not None:
            return self._updater
        from tuf.ngclient import Updater

        metadata = self.store.inside("tuf", self._key)
        metadata.mkdir(parents=True, exist_ok=True)
        if not (metadata / "root.json").exists():
            shutil.copyfile(str(self.trusted_root), str(metadata / "root.json"))
        extra = {"bootstrap": None} if "bootstrap" in inspect.signature(Updater.__init__).parameters else {}
        updater = Updater(str(metadata), self.url + "/metadata/", None, self.url + "/targets/", **extra)
        with tuf_errors(self.url):
            updater.refresh()
        self._updater = updater
        return updater

    def _rollout_version(self, policy: str) -> Optional[Version]:
        """The version a rollout of ``policy`` gives this device, or None when no rollout is published."""
        updater = self._open()
        path = f"{policy}/rollout.json"
        with tuf_errors(self.url):
            info = updater.get_targetinfo(path)
            if info is None:
                return None
            if info.length > MAX_PLAN_BYTES:
                raise CheckFailed("rollout", f"target {path} declares {info.length} bytes (limit {MAX_PLAN_BYTES})")
            where = self.store.inside("tuf", self._key + ".rollout")
            where.mkdir(parents=True, exist_ok=True)
            local = Path(updater.download_target(info, str(where / f"{policy}.json")))
        plan = parse_plan(local.read_bytes(), policy)
        version = version_for(plan, self.device_id, self.labels)
        if version is None:
            ring = ring_of(self.device_id, self.labels, plan.rings)
            raise CheckFailed("rollout", f"the rollout of {policy} gives device {shown(self.device_id)} "
                                         f"({'ring ' + ring if ring else 'in no ring'}) no version yet")
        return version

    def resolve(self, ref: str) -> BundleRef:
        """The target ``<policy>/<version>.tar``; ``<policy>`` alone: its rollout's version for this device, else
        ``<policy>/latest.tar``; custom fields parsed."""
        policy, asked = parse_tuf_ref(ref)
        planned = None if asked else self._rollout_version(policy)
        version = asked or planned
        path = f"{policy}/{version or 'latest'}.tar"
        updater = self._open()
        with tuf_errors(self.url):
            info = updater.get_targetinfo(path)
        if info is None:
            raise CheckFailed("tuf", f"{self.url} publishes no target {path} (no policy {policy}"
                                     f"{' v' + version if version else ''} there)")
        custom = (info.unrecognized_fields.get("custom") or {}).get(CUSTOM)
        if not isinstance(custom, dict):
            raise CheckFailed("tuf", f"target {path} has no custom.{CUSTOM} fields: {shown(info.unrecognized_fields)}")
        where = f"custom.{CUSTOM} of target {path}"
        if custom.get("policy") != policy:
            raise CheckFailed("tuf", f"{where} names policy {shown(custom.get('policy'))}, not {policy}")
        got = Version.parse(custom.get("version"), f"{where}.version", check="tuf")
        if version is not None and got != version:
            raise CheckFailed("tuf", f"{where} names v{got}, not v{version}")
        sha256 = Sha256.parse(info.hashes.get("sha256"), f"sha256 of target {path}", check="tuf")
        if custom.get("bundle_sha256") != sha256:
            raise CheckFailed("tuf", f"{where}.bundle_sha256 {shown(custom.get('bundle_sha256'))} is not the "
                                     f"signed sha256 {sha256[:12]}…")
        if not 0 < info.length <= self.options.max_bytes:
            raise CheckFailed("size", f"target {path} declares {info.length} bytes (limit {self.options.max_bytes})")
        self._infos[path] = info
        return BundleRef(policy, got, ArtifactPath.parse(path, f"target path {path}", check="tuf"), sha256,
                         info.length, "", directed=planned is not None)

    def download(self, ref: BundleRef, part: Path, on_chunk: Optional[Callable[[int], None]] = None) -> DownloadStats:
        """Download the resolved target into ``part``; ngclient checks its length and sha256 (no resume)."""
        with tuf_errors(self.url):
            self._open().download_target(self._infos[ref.path], str(part))
        if on_chunk is not None:
            on_chunk(part.stat().st_size)
        return DownloadStats(attempts=1)
