"""`dtrt serve` from its resolved spec and config: the port bound before anything loads, the sources opened once,
then one pipeline in this process, or Ray Serve replicas planned and deployed behind the same HTTP server."""

from dataclasses import replace

from dtrt.frontend.requests import check_thinking
from dtrt.launch import open_sources, served_model_name
from dtrt.runtime.pipeline import open_pipeline, tokenizer_dir
from dtrt.runtime.spec import RunSpec
from dtrt.serve.server import ServeConfig, bind, exposure_warning, serve_forever


def serve(
    spec: RunSpec,
    cfg: ServeConfig,
    *,
    host: str,
    port: int,
    name: str | None,
    thinking: bool | None,
    replicas: int | None,
    max_replicas: int | None,
    ray_address: str | None,
    log,
):
    """Serve until SIGINT/SIGTERM. `cfg.model_name` is filled in here (`name`, else the served_model_name rule);
    any of `replicas`, `max_replicas`, `ray_address` runs the pipeline as Ray Serve replicas."""
    plan = None
    if replicas is not None or max_replicas is not None or ray_address is not None:
        from dtrt.serve.replicas import ReplicaPlan, import_ray

        plan = ReplicaPlan(1 if replicas is None else replicas, max_replicas, ray_address, spec.threads)
        given = (("--replicas", replicas), ("--max-replicas", max_replicas), ("--ray-address", ray_address))
        import_ray(next(f"{k} {v}" for k, v in given if v is not None))  # before anything loads, in one line
    sock = bind(host, port)  # a taken port fails before the model loads
    try:
        sources = open_sources(spec, log)
        cfg = replace(cfg, model_name=served_model_name(spec, sources, name))
        if plan is None:
            pipe = open_pipeline(spec, sources)
            check_thinking(pipe.tokenizer, thinking)
            workers, what = None, None
        else:
            from dtrt.runtime.tokenizer import open_tokenizer
            from dtrt.serve.replicas import ReplicaWorkers

            check_thinking(open_tokenizer(tokenizer_dir(spec, sources)), thinking)
            pipe, workers = None, ReplicaWorkers(spec, cfg, plan, log)
            workers.deploy()
            count = f"{plan.replicas}-{plan.max_replicas}" if plan.max_replicas else str(plan.replicas)
            what = f"{cfg.model_name} ({spec.method}, {count} replicas x {workers.threads} threads on Ray Serve)"
        if (warning := exposure_warning(host, cfg)) is not None:
            log(warning)
    except BaseException:
        sock.close()
        raise
    serve_forever(pipe, cfg, sock, log=log, workers=workers, what=what)
