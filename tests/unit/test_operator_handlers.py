"""The small pieces of the kopf shell that are not kopf: log filtering of expected
outcomes, and kopf bodies as plain data for the pure mutation."""

import logging

from weightcache.operator.handlers import QuietWaits, _plain


def record(level, msg, name="kopf.objects"):
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_waiting_deletions_and_refused_pods_are_not_errors():
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    f = QuietWaits()
    wait = record(logging.ERROR, "Handler 'finalize' failed temporarily: waiting: deletion waits for 1 client")
    assert f.filter(wait) is False and wait.levelno == logging.DEBUG
    refused = record(logging.ERROR, "Webhook 'mutate-pods' failed permanently: WeightCache 'x' not found")
    assert f.filter(refused) is False and refused.levelname == "INFO"
    logging.getLogger("kopf.objects").setLevel(logging.INFO)
    assert f.filter(record(logging.ERROR, "Webhook 'mutate-pods' failed permanently: nope")) is True
    real = record(logging.ERROR, "Handler 'poll' failed with an exception. Will retry.")
    assert f.filter(real) is True and real.levelno == logging.ERROR


class View:
    """A mapping view like kopf's Body: items(), but not a dict."""

    def __init__(self, d):
        self._d = d

    def items(self):
        return self._d.items()


def test_plain_turns_views_into_dicts_and_keeps_lists():
    body = View({"metadata": View({"labels": {"a": "b"}}), "spec": {"containers": [View({"name": "c"})]}})
    out = _plain(body)
    assert out == {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c"}]}}
    assert type(out["metadata"]) is dict and type(out["spec"]["containers"][0]) is dict
