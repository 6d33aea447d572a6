"""Keeps an Optuna study in the cluster: a journal backend (Optuna's `JournalStorage`) whose
log lives in a ConfigMap owned by the InferenceService, so a tuner or operator that is
restarted elsewhere resumes the study with its trials, and deleting the resource deletes
its history with it (garbage collection through the owner reference).

The log is JSON lines, gzip-compressed in `binaryData` (a ConfigMap holds at most 1 MiB:
about a thousand trials). Appends are read-modify-write with the ConfigMap's
resourceVersion, retried on a conflict, so concurrent writers never lose a line.
Source: Optuna docs, `optuna.storages.journal.BaseJournalBackend`.
"""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Iterable
from typing import Any

import optuna
from optuna.storages.journal import BaseJournalBackend, JournalStorage

from kvpilot.api.crd import GROUP, KIND, VERSION
from kvpilot.api.kube import ApiError, KubeClient

KEY = "journal.jsonl.gz"


class ConfigMapJournal(BaseJournalBackend):
    """Optuna's journal backend over ConfigMap `name` in `namespace` (the module docstring); owner:
    the InferenceService the ConfigMap is created owned by; max_retries: 409 conflicts per append."""

    def __init__(self, kube: KubeClient, namespace: str, name: str, owner: dict[str, Any] | None = None,
                 max_retries: int = 20):
        self.kube, self.namespace, self.name = kube, namespace, name
        self.owner, self.max_retries = owner, max_retries
        self.path = f"/api/v1/namespaces/{namespace}/configmaps/{name}"

    def _read(self) -> tuple[list[str], dict[str, Any] | None]:
        try:
            cm = self.kube.request("GET", self.path)
        except ApiError as e:
            if e.status == 404:
                return [], None
            raise
        blob = (cm.get("binaryData") or {}).get(KEY)
        text = gzip.decompress(base64.b64decode(blob)).decode() if blob else ""
        return [line for line in text.split("\n") if line], cm

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        """The journal's log entries from number `log_number_from` on (none when the ConfigMap does
        not exist yet). Raises ApiError on any API failure but 404."""
        lines, _ = self._read()
        return [json.loads(line) for line in lines[log_number_from:]]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        """Appends `logs` to the journal, creating the ConfigMap on the first write; a PUT with the
        resourceVersion read, re-read and retried on 409. Raises ApiError on another API failure and
        RuntimeError after max_retries conflicts."""
        new = [json.dumps(log, separators=(",", ":")) for log in logs]
        for _ in range(self.max_retries):
            lines, cm = self._read()
            blob = base64.b64encode(gzip.compress("\n".join(lines + new).encode())).decode()
            try:
                if cm is None:
                    meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace,
                                            "labels": {"app.kubernetes.io/managed-by": "kvpilot-tuner"}}
                    if self.owner:
                        meta["ownerReferences"] = [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                                                    "name": self.owner["metadata"]["name"],
                                                    "uid": self.owner["metadata"]["uid"]}]
                    self.kube.request("POST", f"/api/v1/namespaces/{self.namespace}/configmaps",
                                   {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                                    "binaryData": {KEY: blob}})
                else:
                    cm["binaryData"] = {**(cm.get("binaryData") or {}), KEY: blob}
                    self.kube.request("PUT", self.path, cm)  # carries resourceVersion: 409 if someone wrote first
                return
            except ApiError as e:
                if e.status != 409:
                    raise
        raise RuntimeError(f"could not append to ConfigMap {self.namespace}/{self.name}: {self.max_retries} conflicts")


def configmap_storage(kube: KubeClient, isvc: dict[str, Any]) -> optuna.storages.BaseStorage:
    """The study storage for one InferenceService: ConfigMap `<name>-tuning`, owned by it."""
    meta = isvc["metadata"]
    return JournalStorage(ConfigMapJournal(kube, meta["namespace"], f"{meta['name']}-tuning", owner=isvc))
