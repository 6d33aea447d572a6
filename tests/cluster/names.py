"""Name and label validation of built-in objects, as the API server's ValidateObjectMeta does.

Sources: Kubernetes docs "Object Names and IDs" (most resources take a DNS subdomain name,
<= 253 characters; Services a RFC 1035 label, <= 63; Namespaces a RFC 1123 label, <= 63) and
"Labels and Selectors" (value: <= 63 characters, empty or alphanumeric at both ends with
'-', '_', '.' between; key: optional DNS-subdomain prefix and '/', name <= 63). The messages
are apimachinery's (pkg/util/validation).
"""
from __future__ import annotations

import re
from typing import Any

DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = DNS1123_LABEL + r"(\." + DNS1123_LABEL + ")*"
DNS1035_LABEL = "[a-z]([-a-z0-9]*[a-z0-9])?"
LABEL_VALUE = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
QUALIFIED_NAME = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"

_MESSAGES = {
    DNS1035_LABEL: ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                    "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
                    f"regex used for validation is '{DNS1035_LABEL}')", 63),
    DNS1123_LABEL: ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
                    "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
                    f"validation is '{DNS1123_LABEL}')", 63),
    DNS1123_SUBDOMAIN: ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                        "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
                        f"for validation is '{DNS1123_SUBDOMAIN}')", 253),
}
# Kinds whose names follow another rule than a DNS subdomain.
NAME_RULES = {"Service": DNS1035_LABEL, "Namespace": DNS1123_LABEL}


def _check(value: str, pattern: str) -> list[str]:
    message, limit = _MESSAGES[pattern]
    found = [f"must be no more than {limit} characters"] if len(value) > limit else []
    return found + ([] if re.fullmatch(pattern, value) else [message])


def name_errors(kind: str, name: str) -> list[str]:
    return _check(name, NAME_RULES.get(kind, DNS1123_SUBDOMAIN))


def label_errors(labels: Any) -> list[tuple[str, str]]:
    """(key, message) for each invalid label key or value."""
    errors = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if prefix and _check(prefix, DNS1123_SUBDOMAIN):
            errors.append((key, f"prefix part {_check(prefix, DNS1123_SUBDOMAIN)[-1]}"))
        if len(name) > 63 or not re.fullmatch(QUALIFIED_NAME, name):
            errors.append((key, "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
                                "and end with an alphanumeric character, at most 63 characters"))
        if not isinstance(value, str):
            errors.append((key, "label values must be strings"))
            continue
        if len(value) > 63:
            errors.append((value, "must be no more than 63 characters"))
        if not re.fullmatch(LABEL_VALUE, value):
            errors.append((value, "a valid label must be an empty string or consist of alphanumeric characters, '-', "
                                  "'_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  "
                                  f"or 'my_value',  or '12345', regex used for validation is '{LABEL_VALUE}')"))
    return errors
