"""MLflow's artifact store on S3 for ``sim2edge up --artifacts s3://BUCKET[/PREFIX]``.

The tracking server proxies the bucket (``--serve-artifacts``): only the server holds S3 credentials, and every
client — pipelines, devices pulling bundles, telemetry uploads — keeps talking to MLflow alone. Credentials, region
and a non-AWS endpoint (MinIO, Ceph, …: ``MLFLOW_S3_ENDPOINT_URL``) come from the environment as boto3 and MLflow
read them. Before anything starts the bucket is checked with one authenticated request, so a wrong name,
endpoint or key is one line instead of a server that fails at the first upload.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")  # S3's bucket naming rules (the common subset)


class ArtifactStoreError(ValueError):
    """An artifact store that cannot be used; the message names it and what is wrong."""


@dataclass(frozen=True)
class S3Store:
    bucket: str
    prefix: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    @property
    def endpoint(self) -> str | None:
        return os.environ.get("MLFLOW_S3_ENDPOINT_URL") or None


def parse(uri: str) -> S3Store:
    """``s3://BUCKET[/PREFIX]`` as a store, or :class:`ArtifactStoreError` naming what is wrong."""
    scheme, sep, rest = uri.partition("://")
    if scheme != "s3" or not sep:
        raise ArtifactStoreError(f"--artifacts {uri!r}: give s3://BUCKET[/PREFIX] (default: the workspace's folder)")
    bucket, _, prefix = rest.partition("/")
    if not BUCKET.match(bucket):
        raise ArtifactStoreError(f"--artifacts {uri!r}: {bucket!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)")
    return S3Store(bucket, prefix.strip("/"))


def check(store: S3Store, timeout_s: float = 10.0) -> None:
    """One ``HeadBucket`` with the environment's credentials; :class:`ArtifactStoreError` in one line if the bucket
    is missing, forbidden or the endpoint does not answer."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
    except ImportError:
        raise ArtifactStoreError(f"{store.uri}: S3 needs boto3: pip install 'sim2edge[team]'") from None

    where = f"{store.uri}{f' at {store.endpoint}' if store.endpoint else ''}"
    client = boto3.client("s3", endpoint_url=store.endpoint,
                          config=Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1}))
    try:
        client.head_bucket(Bucket=store.bucket)
    except NoCredentialsError:
        raise ArtifactStoreError(f"{where}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                                 f"AWS_PROFILE)") from None
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "?")
        meaning = {"404": "no such bucket", "NoSuchBucket": "no such bucket", "403": "access denied to these "
                   "credentials"}.get(code, f"refused ({code})")
        raise ArtifactStoreError(f"{where}: {meaning}") from None
    except BotoCoreError as e:
        raise ArtifactStoreError(f"{where}: not reachable ({type(e).__name__}: {e})") from None
