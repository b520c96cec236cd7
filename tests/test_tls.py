"""The event channel's TLS as runs use it: off on local processes unless asked for, on by default
on Spark (classic and Connect), always on where the cluster sets ``spark.ssl.enabled`` (where
``tls=False`` is refused as TorchDistributor refuses, unless ``ignoreSsl`` overrides it); each
rank pins the run's certificate, and the key never reaches a rank."""

import re
import socket

import pytest

from helpers import assert_no_survivors, assert_nothing_left, one, touch, wait_until
from torchdist_magic import Distributor, LaunchOptions, shutdown_pools
from torchdist_magic.wire import tls
from torchdist_magic.wire.frames import MAX_HELLO, read_frame
from torchdist_magic.backends import make_backend


def wait_for_file_and_tell(path):
    """Wait for ``path``; what this rank was told about the channel's TLS."""
    import json
    import os
    import time

    while not os.path.exists(path):
        time.sleep(0.02)
    env = json.dumps(dict(os.environ))
    return os.environ.get("TORCHDIST_CHANNEL_CERT", ""), "PRIVATE KEY" in env


def greeting(run):
    """The first frame the run's channel sends a newcomer (the challenge): read in plaintext,
    or through TLS that trusts the run's certificate only."""
    wait_until(lambda: run.channel_address or run.done(), what="the run's channel")
    host, _, port = run.channel_address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    if run.channel_certificate:
        sock = tls.client_context(run.channel_certificate).wrap_socket(sock)
    with sock:
        return read_frame(sock, MAX_HELLO)


def run_and_probe(distributor, tmp_path):
    """Start a run that waits, read its channel's greeting, let it finish; the greeting and
    what every rank was told."""
    marker = str(tmp_path / "go")
    run = distributor.submit(wait_for_file_and_tell, marker)
    try:
        hello = greeting(run)
    finally:
        touch(marker)
    return run, hello, run.result(timeout=180)


def test_local_processes_are_not_encrypted_by_default(local_distributor, tmp_path):
    run, hello, told = run_and_probe(local_distributor(2, all_ranks=True), tmp_path)
    assert "nonce" in hello  # the challenge, readable by anyone on the wire
    assert not run.channel_encrypted and run.channel_certificate == ""
    assert told == [("", False), ("", False)]
    assert_no_survivors(run)


def test_local_processes_with_tls_pin_the_runs_certificate(local_distributor, tmp_path):
    run, hello, told = run_and_probe(local_distributor(2, all_ranks=True, tls=True), tmp_path)
    assert "nonce" in hello  # only through TLS with the run's certificate
    assert run.channel_encrypted and "BEGIN CERTIFICATE" in run.channel_certificate
    assert told == [(run.channel_certificate, False)] * 2  # the certificate, never the key
    assert_no_survivors(run)


def test_a_warm_pool_without_tls_refuses_a_run_that_asks_for_it(local_distributor):
    try:
        first = local_distributor(2, warm=True).submit(one)
        assert first.result(timeout=120) == 1 and not first.channel_encrypted
        with pytest.raises(
            ValueError,
            match=r"^warm pool-\d+'s event channel is not encrypted \(it started "
            r"without TLS\), and this run's must be; stop it first",
        ):
            local_distributor(2, warm=True, tls=True).submit(one)
        again = local_distributor(2, warm=True, tls=False).submit(one)  # the pool still serves
        assert again.result(timeout=120) == 1
    finally:
        shutdown_pools()


@pytest.mark.spark
def test_a_spark_run_is_encrypted_by_default(spark_local2, tmp_path):
    run, hello, told = run_and_probe(Distributor(2, local_mode=False, show=None, all_ranks=True), tmp_path)
    assert "nonce" in hello
    assert run.channel_encrypted and "BEGIN CERTIFICATE" in run.channel_certificate
    assert told == [(run.channel_certificate, False)] * 2
    assert_nothing_left(run)


@pytest.mark.spark
def test_a_spark_connect_run_is_encrypted_by_default(spark_connect, tmp_path):
    run, hello, told = run_and_probe(Distributor(1, local_mode=False, show=None), tmp_path)
    assert "nonce" in hello
    assert run.channel_encrypted and told == (run.channel_certificate, False)
    assert_nothing_left(run)


REFUSAL = re.escape(
    "tls=False/--no-tls was asked for, but this Spark cluster has TLS encryption enabled (spark.ssl.enabled=true), "
    "and the event channel would carry every rank's logs, metrics and rank 0's value across the network "
    "unencrypted. Leave TLS on (the default on Spark), or, to run unencrypted anyway, set "
    "'pytorch.spark.distributor.ignoreSsl' to 'true' in the Spark configuration"
)


@pytest.mark.spark
def test_spark_ssl_enabled_refuses_an_unencrypted_channel_unless_ignore_ssl(spark_local2, tmp_path):
    conf = spark_local2.sparkContext._conf  # as TorchDistributor's own tests set it
    try:
        conf.set("spark.ssl.enabled", "true")
        # and in the session's own conf, as a cluster's spark-defaults put it there too: what the
        # session's conf takes over from its context at some point is not this test's to decide
        spark_local2.conf.set("spark.ssl.enabled", "true")
        with pytest.raises(ValueError, match=f"^{REFUSAL}$"):
            Distributor(2, local_mode=False, show=None, tls=False).submit(one)
        assert make_backend(LaunchOptions(backend="spark")).check(LaunchOptions(backend="spark")).tls
        # a notebook's spark.conf.set counts, as it does for TorchDistributor
        spark_local2.conf.set("pytorch.spark.distributor.ignoreSsl", "true")
        with pytest.warns(
            UserWarning,
            match=r"^this Spark cluster has TLS encryption enabled "
            r"\(spark.ssl.enabled=true\), but with tls=False/--no-tls and "
            r"pytorch.spark.distributor.ignoreSsl=true this run's event "
            r"channel is not encrypted: anyone who can watch the cluster's "
            r"network reads every rank's logs and metrics, the notebook values "
            r"sent to the ranks and rank 0's value \(the trained model\), and can "
            r"tell a rank from the driver by its traffic\. Every record is still "
            r"authenticated: nobody without the run's secrets can change one, "
            r"or make a rank or the driver take one of theirs$",
        ) as caught:
            run, hello, told = run_and_probe(Distributor(1, local_mode=False, show=None, tls=False), tmp_path)
        # once (pyspark 3.5 may add warnings of its own)
        assert len([w for w in caught if "TLS encryption enabled" in str(w.message)]) == 1
        assert "nonce" in hello and not run.channel_encrypted and told == ("", False)
        assert_nothing_left(run)
    finally:
        conf._jconf.remove("spark.ssl.enabled")
        spark_local2.conf.unset("spark.ssl.enabled")  # the session's own conf had taken it up too
        spark_local2.conf.unset("pytorch.spark.distributor.ignoreSsl")
