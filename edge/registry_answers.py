"""What the registry says, parsed into typed values before any use (edge/values.py).

A ``model_version`` answer must name the policy asked for and a positive integer version (the one asked for),
and its tags must name the bundle: ``sim2edge.bundle.path`` (relative, normalized), ``sim2edge.bundle.sha256``
(64 lowercase hex digits) and ``sim2edge.bundle.size`` (a byte count within the device's limit); anything else
is refused (check ``registry``, or ``size``) naming the field and value. JSON answers are parsed with bounded
nesting (:data:`MAX_JSON_DEPTH`); an integer too long for any field the agent reads stays text, so the typed
parsers refuse it (``registry``) instead of the JSON parser failing as if the answer were cut short.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Tuple

from edge.errors import CheckFailed
from edge.values import ID, ArtifactPath, PolicyName, Sha256, Version, byte_count, shown

TAG_PATH, TAG_SHA256, TAG_SIZE = "sim2edge.bundle.path", "sim2edge.bundle.sha256", "sim2edge.bundle.size"
_ALIAS = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,254}")
MAX_JSON_DEPTH = 32
"""Nesting of objects and arrays in a registry answer (MLflow's are at most 4 deep)."""
_MAX_INT_DIGITS = 19


@dataclass(frozen=True)
class BundleRef:
    """What the registry says a version's bundle is: every field parsed (see :func:`bundle_ref`)."""

    policy: PolicyName
    version: Version
    path: ArtifactPath
    sha256: Sha256
    size: int
    run_id: str
    directed: bool = False
    """A signed rollout plan names this version for the device (edge/rollout_plan.py): it may be older than the
    active one (a halted ring rolls back); TUF's own rollback protection keeps an old plan from being replayed."""


def parse_ref(ref: str) -> Tuple[PolicyName, Optional[str], Optional[Version]]:
    """``policy@alias`` or ``policy@<version number>`` → (policy, alias or None, version or None)."""
    policy, sep, what = ref.partition("@")
    usage = f"policy reference {shown(ref)} must look like <policy>@<alias> or <policy>@<version>"
    if not sep or not policy or not what:
        raise ValueError(usage)
    try:
        name = PolicyName.parse(policy, check="reference")
        if re.fullmatch(r"[0-9]+", what):
            return name, None, Version.parse(what, check="reference")
    except CheckFailed as e:
        raise ValueError(f"{usage}: {e.detail}") from None
    if not _ALIAS.fullmatch(what):
        raise ValueError(f"{usage}: alias {shown(what)} is not an MLflow alias name")
    return name, what, None


def bundle_ref(answer: object, policy: PolicyName, version: Optional[Version], max_bytes: int) -> BundleRef:
    """Parse a ``model_version`` answer (alias or version lookup) into a :class:`BundleRef`, or refuse it."""
    where = f"{policy}@{version}" if version else policy
    mv = answer.get("model_version") if isinstance(answer, dict) else None
    if not isinstance(mv, dict):
        raise CheckFailed("registry", f"the answer for {where} has no model_version object: {shown(answer)}")
    if "name" in mv and mv["name"] != policy:
        raise CheckFailed("registry", f"asked for {policy}, the registry answered model {shown(mv['name'])}")
    got = Version.parse(mv.get("version"), f"model_version.version of {where}")
    if version is not None and got != version:
        raise CheckFailed("registry", f"asked for {policy} v{version}, the registry answered v{got}")
    raw_tags = mv.get("tags", [])
    if not isinstance(raw_tags, list) or not all(
            isinstance(t, dict) and isinstance(t.get("key"), str) and isinstance(t.get("value"), str) for t in raw_tags):
        raise CheckFailed("registry", f"tags of {policy} v{got} are not a list of string key/value pairs: "
                                      f"{shown(raw_tags)}")
    tags = {t["key"]: t["value"] for t in raw_tags}
    missing = [t for t in (TAG_PATH, TAG_SHA256, TAG_SIZE) if t not in tags]
    if missing:
        raise CheckFailed("registry", f"{policy} version {got} has no bundle (missing tags {missing})")
    size = byte_count(tags[TAG_SIZE], f"tag {TAG_SIZE} of {policy} v{got}", max_bytes)
    if size == 0:
        raise CheckFailed("registry", f"tag {TAG_SIZE} of {policy} v{got} declares an empty bundle")
    run_id = mv.get("run_id") or ""
    if not isinstance(run_id, str) or (run_id and not ID.fullmatch(run_id)):
        raise CheckFailed("registry", f"run_id of {policy} v{got} {shown(run_id)} is not a run id")
    return BundleRef(policy, got, ArtifactPath.parse(tags[TAG_PATH], f"tag {TAG_PATH} of {policy} v{got}"),
                     Sha256.parse(tags[TAG_SHA256], f"tag {TAG_SHA256} of {policy} v{got}"), size, run_id)


def parse_json(data: bytes, what: str) -> object:
    """``data`` as JSON, refused (check ``registry``) if nested deeper than :data:`MAX_JSON_DEPTH`; an integer
    of more than 19 digits stays its text. Raises ``ValueError`` for bytes that are not JSON."""
    try:
        value = json.loads(data, parse_int=lambda t: int(t) if len(t) <= _MAX_INT_DIGITS else t)
    except RecursionError:
        value, depth = None, MAX_JSON_DEPTH + 1
    else:
        depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise CheckFailed("registry", f"{what} is JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def json_depth(value: object) -> int:
    """How deeply objects and arrays nest in a parsed JSON ``value`` (a scalar is 0); iterative."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest
