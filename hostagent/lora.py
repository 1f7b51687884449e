"""Runtime LoRA adapters, on the host: load and unload them on a group's running instances through
vLLM's own endpoints, keep the record that makes them survive a restart, and restore it.

vLLM (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which start_cluster.sh sets for a group with
runtime_lora) answers `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`: 200 with a text body on success, 400 when the adapter is
already loaded or its path is no adapter, 404 when unloading one it does not hold (and 404 for both when
the engine was started without runtime updating: the endpoints are not registered then).

The record, run/lora_adapters.json, holds `{"adapters": [{"model", "name", "path", "added_at"}]}` in the
order they were added; written atomically (a temporary file, then a rename). An adapter goes into it
when at least one instance loaded it (the partial-failure policy: the instances that failed get it back
from the record when the host agent next starts them), and leaves it on `lora remove`. `inv stop`
keeps it: a later deploy or restart loads it again.

Standard library only, Python 3.6+: the state probe bundles it to read the record.
"""
import json
import os
import time

from hostagent import files, httpcall, instances, layout, proxyadmin
from hostagent.errors import LoraError

LOAD_TIMEOUT_S = 300.0        # a large adapter on a busy engine takes a while
UNLOAD_TIMEOUT_S = 60.0


# --- the record ------------------------------------------------------------------------------------

def record_path(deploy_dir):
    """run/lora_adapters.json under deploy_dir."""
    return layout.path(deploy_dir, layout.LORA_ADAPTERS)


def read_record(deploy_dir):
    """The recorded adapters (dicts with model, name, path, added_at) in the order they were added; []
    when there is no record. LoraError when the file cannot be read or is not a record."""
    path = record_path(deploy_dir)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise LoraError("cannot read %s (%s); fix its permissions." % (path, e.strerror)) from None
    except ValueError:
        raise LoraError("%s is not valid JSON; fix it or remove it, then `lora add` the adapters again."
                        % path) from None
    adapters = data.get("adapters") if isinstance(data, dict) else None
    if not isinstance(adapters, list) or not all(
            isinstance(a, dict) and all(isinstance(a.get(k), str) for k in ("model", "name", "path"))
            for a in adapters):
        raise LoraError("%s is not a record of adapters ({\"adapters\": [{\"model\", \"name\", \"path\"}]}); "
                        "fix it or remove it, then `lora add` the adapters again." % path)
    return adapters


def read_record_quiet(deploy_dir):
    """(adapters, None), or ([], why) when the record cannot be read: for status and the restore."""
    try:
        return read_record(deploy_dir), None
    except LoraError as e:
        return [], str(e)


def write_record(deploy_dir, adapters):
    """Replace the record atomically: a temporary file beside it, then a rename."""
    path = record_path(deploy_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    files.write_atomic(path, json.dumps({"adapters": adapters}, indent=1) + "\n")


def recorded(adapters, model, name):
    """The record's entry of adapter name on model, None when there is none."""
    return next((a for a in adapters if a["model"] == model and a["name"] == name), None)


# --- the groups (hostagent.json's "models", present in the models form only) ------------------------

def _plain(cfg):
    return ("%s serves one model in the plain form, which takes no runtime adapters; set `runtime_lora: true` "
            "on the host (or on a group of its `models:`) and deploy again." % cfg.get("host", "this host"))


def group(cfg, model):
    """The group named model in hostagent.json; LoraError when the host has no groups or not that one."""
    groups = cfg.get("models")
    if not groups:
        raise LoraError(_plain(cfg))
    for g in groups:
        if g["name"] == model:
            return g
    raise LoraError("%s has no model %r; its models are %s (--model takes a group's served name)."
                    % (cfg.get("host", "this host"), model, ", ".join(g["name"] for g in groups)))


def check_add(cfg, model, name, path, adapters):
    """The group adapter name may be added to; LoraError (one sentence, nothing sent) when it may not."""
    g = group(cfg, model)
    if not g.get("runtime_lora"):
        raise LoraError("model %s does not take adapters at runtime; set `runtime_lora: true` in its entry of "
                        "the inventory's `models:` and deploy again." % model)
    if not name or "/" in name or name.strip() != name:
        raise LoraError("the adapter name %r is not usable as a model name; give a name without slashes or "
                        "surrounding spaces." % name)
    for other in cfg["models"]:
        taken = ([("its served name", other["name"])] + [("an alias", a) for a in other.get("aliases") or []]
                 + [("a static adapter", a) for a in other.get("lora_modules") or {}])
        for what, value in taken:
            if value == name:
                raise LoraError("the name %s is already %s of model %s: requests name it to reach that model; "
                                "choose another --name." % (name, what, other["name"]))
    for a in adapters:
        if a["name"] == name and a["model"] != model:
            raise LoraError("the name %s is already a runtime adapter of model %s; choose another --name, or "
                            "`lora remove` it there first." % (name, a["model"]))
        if a["name"] == name and a["path"] != path:
            raise LoraError("the adapter %s of model %s is recorded from %s; `lora remove` it first to load it "
                            "from %s." % (name, model, a["path"], path))
    if not os.path.isabs(path):
        raise LoraError("the adapter path %s is relative; give its absolute path on the host." % path)
    if not os.path.exists(path):
        raise LoraError("the adapter path %s does not exist on %s; copy the adapter there first."
                        % (path, cfg.get("host", "the host")))
    return g


# --- vLLM's endpoints -----------------------------------------------------------------------------

def _post(inst, path, body, timeout):
    """(status, text) of one POST to an instance; (None, reason) when it does not answer."""
    answer = httpcall.call(instances.url(inst) + path, "POST", body, timeout)
    return (answer.status, answer.text()) if answer.status is not None else (None, answer.error)


def _message(text):
    """The message of a vLLM error body ({"error": {"message"}}, {"message"} or FastAPI's {"detail"})."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key])[:300]
    return text.strip()[:300]


def _no_route(text):
    """Whether a 404 is the web framework's own (the route is not registered), not the engine's answer."""
    try:
        return json.loads(text) == {"detail": "Not Found"}
    except ValueError:
        return False


def load(inst, name, path, timeout=LOAD_TIMEOUT_S):
    """Load adapter name from path on one instance: ("loaded" | "already" | "failed", message)."""
    status, text = _post(inst, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout)
    if status == 200:
        return "loaded", "loaded %s" % name
    message = _message(text)
    if status == 400 and "already" in message.lower():
        return "already", "%s was already loaded" % name
    if status is None:
        return "failed", "no answer (%s)" % message
    if status == 404 and _no_route(text):
        return "failed", ("the engine has no runtime adapter endpoint (404: started without "
                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; deploy again with runtime_lora: true)")
    return "failed", "%d: %s" % (status, message)


def unload(inst, name, timeout=UNLOAD_TIMEOUT_S):
    """Unload adapter name from one instance: ("unloaded" | "absent" | "failed", message)."""
    status, text = _post(inst, "/v1/unload_lora_adapter", {"lora_name": name}, timeout)
    if status == 200:
        return "unloaded", "unloaded %s" % name
    if status == 404:
        return "absent", "%s was not loaded" % name + (" (the engine takes no runtime adapters)"
                                                       if _no_route(text) else "")
    if status is None:
        return "failed", "no answer (%s)" % text
    return "failed", "%d: %s" % (status, _message(text))


def served(inst, timeout=10.0):
    """The model ids an instance's GET /v1/models lists (its names and adapters), None when it does not answer."""
    answer = httpcall.get(instances.url(inst) + "/v1/models", timeout)
    if answer.status != 200:
        return None
    try:
        return {m["id"] for m in answer.json().get("data", [])}
    except (KeyError, TypeError, AttributeError):
        return None


def running(cfg, i):
    """Whether instance i runs and answers /health 200 (one that is loading gets the record when it is up)."""
    inst = cfg["instances"][i]
    return bool(instances.recorded_pid(cfg["deploy_dir"], cfg["deployment_id"], i)) and \
        instances.health(instances.url(inst)) == 200


def refresh_proxy(cfg, say):
    """Ask the proxy to re-read every backend's /v1/models, so an added name routes at once; a proxy that
    does not answer, or has no such call, learns it at its next health round (not a failure)."""
    status, body = proxyadmin.refresh_models(cfg["admin_port"])
    if status == 200:
        say("the proxy re-read the instances' models")
    else:
        why = "it does not answer" if status is None else "it answered %s" % status
        say("the proxy will learn the change at its next health round (%s to POST /admin/refresh-models)" % why)


# --- the commands ---------------------------------------------------------------------------------

def _names(indexes):
    return ", ".join(str(i) for i in indexes)


def add(cfg, model, name, path, say=print):
    """Load adapter name (path) on every running instance of model and record it: the FLEET_RESULT dict.
    A refusal raises LoraError before anything is sent."""
    d = cfg["deploy_dir"]
    adapters = read_record(d)
    g = check_add(cfg, model, name, path, adapters)
    results = []
    for i in g["instances"]:
        inst = cfg["instances"][i]
        if not running(cfg, i):
            say("instance %d: not running; it gets %s from the record when the host agent starts it" % (i, name))
            results.append({"index": i, "status": "skipped", "message": "not running (stopped, dead or loading); "
                            "it gets the adapter from the record when the host agent starts it"})
            continue
        status, message = load(inst, name, path)
        say("instance %d: %s" % (i, message))
        results.append({"index": i, "status": status, "message": message})
    loaded = [r["index"] for r in results if r["status"] in ("loaded", "already")]
    failed = [r for r in results if r["status"] == "failed"]
    result = {"ok": bool(loaded) and not failed, "model": model, "name": name, "path": path,
              "instances": results, "recorded": bool(loaded)}
    if loaded:
        if recorded(adapters, model, name) is None:
            write_record(d, adapters + [{"model": model, "name": name, "path": path, "added_at": round(time.time())}])
        say("recorded %s in %s: an instance the host agent starts gets it back" % (name, layout.LORA_ADAPTERS))
        refresh_proxy(cfg, say)
    if not results or len(results) == len([r for r in results if r["status"] == "skipped"]):
        result["error"] = ("no instance of model %s is running (instances %s); start them (`inv deploy`) and add "
                           "the adapter again; nothing was recorded." % (model, _names(g["instances"])))
    elif not loaded:
        result["error"] = ("%s was loaded on no instance of %s (%s); nothing was recorded."
                           % (name, model, "; ".join("instance %d: %s" % (r["index"], r["message"]) for r in failed)))
    elif failed:
        result["error"] = ("%s is loaded on instance(s) %s and recorded, but instance(s) %s failed (%s); a restart "
                           "of those (`inv restart --instance I`) loads it from the record, `lora remove` takes it "
                           "off everywhere." % (name, _names(loaded), _names(r["index"] for r in failed),
                                                "; ".join(r["message"] for r in failed)))
    return result


def remove(cfg, model, name, say=print):
    """Unload adapter name from every running instance of model and drop it from the record: the
    FLEET_RESULT dict. A refusal raises LoraError before anything is sent."""
    d = cfg["deploy_dir"]
    adapters = read_record(d)
    g = group(cfg, model)
    if name in (g.get("lora_modules") or {}):
        raise LoraError("%s is a static adapter of model %s (its `lora_modules` in the inventory); remove it "
                        "there and deploy again." % (name, model))
    results = []
    for i in g["instances"]:
        if not running(cfg, i):
            results.append({"index": i, "status": "skipped", "message": "not running; it starts without the adapter"})
            continue
        status, message = unload(cfg["instances"][i], name)
        say("instance %d: %s" % (i, message))
        results.append({"index": i, "status": status, "message": message})
    was = recorded(adapters, model, name)
    if was is not None:
        write_record(d, [a for a in adapters if a is not was])
        say("dropped %s from %s" % (name, layout.LORA_ADAPTERS))
    unloaded = [r["index"] for r in results if r["status"] == "unloaded"]
    failed = [r for r in results if r["status"] == "failed"]
    result = {"ok": not failed, "model": model, "name": name, "instances": results, "recorded": False}
    if was is None and not unloaded and not failed:
        others = [a["name"] for a in adapters if a["model"] == model]
        result["ok"] = False
        result["error"] = ("model %s has no runtime adapter %s (recorded: %s); nothing changed."
                           % (model, name, ", ".join(others) or "none"))
    elif failed:
        result["error"] = ("%s is dropped from the record but instance(s) %s failed to unload it (%s); a restart of "
                           "those (`inv restart --instance I`) starts them without it."
                           % (name, _names(r["index"] for r in failed), "; ".join(r["message"] for r in failed)))
    if was is not None or unloaded:
        refresh_proxy(cfg, say)
    return result


def listing(cfg, say=print):
    """Each group's adapters, static and runtime, and where each runtime one is loaded: the FLEET_RESULT dict."""
    adapters = read_record(cfg["deploy_dir"])
    models = []
    for g in cfg.get("models") or []:
        have = {i: served(cfg["instances"][i]) for i in g["instances"] if running(cfg, i)}
        runtime = []
        for a in (a for a in adapters if a["model"] == g["name"]):
            on = [i for i, ids in sorted(have.items()) if ids and a["name"] in ids]
            runtime.append({"name": a["name"], "path": a["path"], "added_at": a.get("added_at"), "loaded_on": on,
                            "missing_on": [i for i in g["instances"] if i not in on]})
        static = sorted(g.get("lora_modules") or {})
        models.append({"name": g["name"], "runtime_lora": bool(g.get("runtime_lora")), "static": static,
                       "runtime": runtime})
        say("model %s: %s" % (g["name"], "; ".join(
            ["static %s" % s for s in static]
            + ["runtime %s (%s) on instance(s) %s%s" % (r["name"], r["path"], _names(r["loaded_on"]) or "none",
                                                         ", missing on %s" % _names(r["missing_on"])
                                                         if r["missing_on"] else "") for r in runtime])
            or "no adapters" + ("" if g.get("runtime_lora") else " (runtime_lora is off)")))
    if not cfg.get("models"):
        say(_plain(cfg))
    return {"ok": True, "models": models}


def restore(cfg, i, say=print):
    """Load the recorded adapters of instance i's group that it does not serve yet (after a start, once
    /health is 200, before the proxy routes to it): [] when its group has none, else one step."""
    model = cfg["instances"][i].get("model")
    adapters, why = read_record_quiet(cfg["deploy_dir"])
    what = "instance %d adapters" % i
    if why:
        return [{"name": what, "status": "failed", "message": why}]
    wanted = [a for a in adapters if a["model"] == model] if model else []
    if not wanted:
        return []
    inst = cfg["instances"][i]
    have = served(inst) or set()
    loaded, failed = [], []
    for a in wanted:
        if a["name"] in have:
            continue
        status, message = load(inst, a["name"], a["path"])
        if status == "failed":
            failed.append("%s (%s): %s" % (a["name"], a["path"], message))
        else:
            loaded.append(a["name"])
    if loaded:
        say("instance %d: restored adapter(s) %s" % (i, ", ".join(loaded)))
    if failed:
        say("instance %d: adapter(s) not restored: %s" % (i, "; ".join(failed)))
        return [{"name": what, "status": "failed", "message": "not restored: %s; the instance serves %s without "
                 "them (`lora remove` them, or fix the path and restart it)" % ("; ".join(failed), model)}]
    if loaded:
        return [{"name": what, "status": "changed", "message": "restored %s from %s" % (", ".join(loaded),
                                                                                     layout.LORA_ADAPTERS)}]
    return [{"name": what, "status": "ok", "message": "already serves %s" % ", ".join(a["name"] for a in wanted)}]
