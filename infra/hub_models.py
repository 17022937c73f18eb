"""Models named by Hugging Face Hub id (`model.path: Qwen/Qwen2.5-0.5B-Instruct`, and grpo.reward_models[i].path),
resolved through huggingface_hub: its cache first (HF_HOME, HF_HUB_CACHE), HF_HUB_OFFLINE honoured, a download of the
files a run needs when online. The driver resolves once, before any actor starts, and every actor (learners, the
reference, engines, reward models) loads that snapshot folder; the run's config records the commit it resolved to
(model.revision, grpo.reward_models[i].revision), so a resumed run loads the same weights even if the Hub moved."""
from __future__ import annotations

import re
from pathlib import Path

# org/name: what the Hub calls a repo id. A local folder of that name wins (a relative path the user meant).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# what engines, learners and the tokenizer read (not the .bin / .pt / .gguf copies many repos also hold)
RUN_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
             "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "*.model", "chat_template*"]


class HubModelError(ValueError):
    """A Hub model that cannot be resolved: one line naming it and the fix."""


def is_hub_id(path: str | None) -> bool:
    """model.path names a Hub repo (org/name) rather than a local folder or an s3:// URL."""
    return bool(path) and bool(HUB_ID.match(str(path))) and not Path(str(path)).expanduser().exists()


def resolve_hub_model(repo_id: str, revision: str | None = None, field: str = "model.path") -> tuple[Path, str]:
    """(the snapshot folder holding the run's files, the commit it is). Raises HubModelError with the fix."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    at = f" at revision {revision}" if revision else ""
    revision_field = f"{field.rpartition('.')[0]}.revision"  # model.revision, grpo.reward_models[i].revision
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=RUN_FILES))
    except GatedRepoError:
        raise HubModelError(f"{field}={repo_id!r} is a gated Hub repo: accept its terms on huggingface.co and log in "
                            "(`hf auth login`, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubModelError(f"{revision_field}={revision!r} is not a branch, tag or commit of {repo_id!r}") from None
    except RepositoryNotFoundError:
        raise HubModelError(f"{field}={repo_id!r} is no model on the Hub (a private one needs HF_TOKEN), and no "
                            "local folder of that name exists") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise HubModelError(f"{field}: {repo_id}{at} is not in the cache at {constants.HF_HUB_CACHE} and "
                                f"HF_HUB_OFFLINE=1: run `hf download {repo_id}` or unset HF_HUB_OFFLINE") from None
        raise HubModelError(f"{field}: {repo_id}{at} is not in the cache at {constants.HF_HUB_CACHE} and the Hub "
                            f"cannot be reached: run `hf download {repo_id}` where it can, or point {field} at a "
                            "local folder") from None
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise HubModelError(f"{field}: {repo_id}{at} holds no config.json and *.safetensors weights: spillover loads "
                            "safetensors only (never pickles)")
    return folder, folder.name


def resolve_on_other_nodes(repo_id: str, commit: str, folder: Path, field: str = "model.path") -> list[dict]:
    """The same commit resolved on every other alive node of the joined Ray cluster, through that node's own Hub
    cache (a download there when it is online), so actors anywhere load `folder`. A node whose cache puts the snapshot
    elsewhere (another HF_HOME or HF_HUB_CACHE) is one HubModelError. -> one {node_id, path} per other node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    resolve = ray.remote(num_cpus=0, max_retries=0)(snapshot_folder)
    found = ray.get([resolve.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                     .remote(repo_id, commit, field) for node in others])
    for node, there in zip(others, found):
        if Path(there) != Path(folder):
            raise HubModelError(f"{field}: {repo_id} at {commit} lies in {there} on node {node} but in {folder} on the "
                                "driver's node: give every node the same HF_HOME (or HF_HUB_CACHE)")
    return [{"node_id": node, "path": there} for node, there in zip(others, found)]


def snapshot_folder(repo_id: str, commit: str, field: str) -> str:
    """resolve_hub_model's folder, as text (what a node's Ray task returns)."""
    return str(resolve_hub_model(repo_id, commit, field)[0])


def resolve_reward_models(cfg) -> tuple[object, list]:
    """(cfg, a RunConfig, with each grpo.reward_models entry named by Hub id at the commit it resolved to; the entries
    the reward model actors load, a Hub id's path replaced by its snapshot folder). The driver calls this once,
    before any actor starts; a resume then loads the recorded commits. Local folders pass as they are."""
    recorded, loaded = [], []
    for i, entry in enumerate(cfg.grpo.reward_models):
        if is_hub_id(entry.path):
            folder, commit = resolve_hub_model(entry.path, entry.revision, field=f"grpo.reward_models[{i}].path")
            entry = entry.model_copy(update={"revision": commit})
            loaded.append(entry.model_copy(update={"path": str(folder)}))
        else:
            loaded.append(entry)
        recorded.append(entry)
    if recorded == list(cfg.grpo.reward_models):
        return cfg, loaded
    return cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"reward_models": recorded})}), loaded
