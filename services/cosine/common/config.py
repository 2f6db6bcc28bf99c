"""Typed settings shared by every service: environment (COSINE_<SERVICE>_*) and command line."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

S = TypeVar("S", bound="ServiceSettings")


class ServiceSettings(BaseSettings):
    """What every gRPC service is configured with."""

    model_config = SettingsConfigDict(extra="ignore", cli_kebab_case=True, cli_implicit_flags=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0: any free port)")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus /metrics port (unset: off, 0: any)")
    drain_timeout_s: float = Field(10.0, ge=0, description="on SIGTERM, how long in-flight streams may finish")
    shutdown_delay_s: float = Field(0.0, ge=0, description="on SIGTERM, how long to report NOT_SERVING before draining")
    max_message_mb: int = Field(64, ge=1, description="largest gRPC message sent or received")
    max_connection_age_s: float = Field(0.0, ge=0, description=(
        "ask each client to reconnect (GOAWAY) after this many seconds, so long-lived channels re-resolve and spread over "
        "new replicas; open streams finish first (0: never)"))
    pool_poll_interval_s: float = Field(0.5, gt=0, description=(
        "how often a caller asks each replica it calls for its load and readiness (cosine.common.v1.Load)"))
    pool_resolve_interval_s: float = Field(5.0, gt=0, description=(
        "how often dns:/// and file: addresses are resolved again, so new replicas join and removed ones leave"))
    reconnect_backoff_max_s: float = Field(0.5, gt=0, description=(
        "longest wait between a channel's tries to connect to a service that is not up (gRPC's own default grows to "
        "120 s): a replica that starts late or comes back is reached within this, and taken into use at the next poll"))
    log_level: str = Field("INFO", description="logging level")
    tls_cert_file: str = Field("", description="PEM certificate this server presents (TLS on its port); with tls_ca_file also its client certificate")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file")
    tls_client_ca_file: str = Field("", description="require callers to present a certificate signed by this CA (mTLS)")
    tls_ca_file: str = Field("", description="CA that signs the services this one calls: its channels use TLS and verify them")
    health_port: int | None = Field(None, ge=0, le=65535, description=(
        "also serve gRPC health alone in plaintext on this port (Kubernetes' gRPC probes cannot speak TLS); unset: off"))
    trace_exporter: Literal["none", "console", "otlp", "memory"] = Field(
        "none", description="where spans go: none (tracing off, no cost), console, otlp, memory (kept in the process, for tests)")
    otlp_endpoint: str = Field("", description="OTLP/gRPC collector HOST:PORT or URL; setting it turns on the otlp exporter")
    trace_sample_ratio: float = Field(1.0, ge=0, le=1, description="share of new traces recorded (callers' decisions are kept)")

    @model_validator(mode="after")
    def _check_tls(self) -> "ServiceSettings":
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mTLS) needs the server's own tls_cert_file and tls_key_file")
        return self

    @model_validator(mode="after")
    def _check_tracing(self) -> "ServiceSettings":
        if self.otlp_endpoint and self.trace_exporter == "none":
            self.trace_exporter = "otlp"
        if self.trace_exporter == "otlp" and not self.otlp_endpoint:
            raise ValueError("trace_exporter otlp needs otlp_endpoint (HOST:PORT of an OTLP/gRPC collector)")
        return self

    @classmethod
    def load(cls: type[S], argv: list[str] | None = None, **overrides: Any) -> S:
        """Settings from (lowest first) defaults, environment, overrides, and argv when given."""
        if argv is None:
            return cls(**overrides)
        return cls(_cli_parse_args=argv, _cli_prog_name=cls.prog_name(), **overrides)

    @classmethod
    def prog_name(cls) -> str:
        return "cosine"


class ModelSettings(ServiceSettings):
    """Settings of a service that holds model weights."""

    model: str = Field("", description="model directory (or a `cosine zoo` name); empty: the zoo's default")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    dtype: str = Field("auto", description="float32, bfloat16, float16 or auto (fp32 on CPU, bf16 on CUDA)")
    threads: int = Field(0, ge=0, description="torch intra-op threads (0: torch's default)")
    wedged_after_s: float = Field(300.0, ge=0, description=(
        "liveness reports NOT_SERVING while one model call has run this long (a wedged model thread; 0: off)"))

    @model_validator(mode="after")
    def _check_dtype(self) -> "ModelSettings":
        if self.dtype not in {"auto", "float32", "bfloat16", "float16"}:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        return self
