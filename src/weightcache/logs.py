"""Structured logs: one JSON object per line on stderr, quiet unless asked.

Code logs with `extra={"fields": {...}}`; the fields become keys of the line.
"""

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record):
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str = "warning") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("weightcache")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
