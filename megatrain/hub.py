"""Hugging Face Hub ids where a setting takes a local path: `model.pretrained`, `data.tokenizer`
and `data.chat_template` (a model repo, resolved to its snapshot folder by `huggingface_hub`);
`data.path`, `data.eval_path` and the keys of `data.mix` (a dataset repo, read by
`datasets.load_dataset`).

Both libraries keep their own caches and honour HF_HUB_OFFLINE, HF_HOME and HF_HUB_CACHE. A
setting is taken for a Hub id only where no such local file or folder exists and it is spelt as
one (`name` or `org/name`, without a data file's or a template's suffix); a Hub id that is neither
cached nor reachable is refused with the setting's name, before anything is allocated.
"""
from __future__ import annotations

from pathlib import Path

# a model's files the engine reads: its config, safetensors shards (and their index), the
# tokenizer and chat template; never the other weight formats a repo may carry (.bin, .pth, GGUF)
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt"]
TOKENIZER_FILES = ["*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt"]
# names of files, never repo ids: a data file's, a chat template's
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow", ".jinja")


def is_hub_id(value: str) -> bool:
    """Whether `value` names no local file or folder and is spelt as a Hub repo id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    if Path(value).exists() or value.endswith(FILE_SUFFIXES):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _offline_hint(repo: str, kind: str) -> str:
    from huggingface_hub import constants
    where = f"the cache {constants.HF_HUB_CACHE}"
    fetch = f"hf download {repo}" + (" --repo-type dataset" if kind == "dataset" else "")
    if constants.HF_HUB_OFFLINE:
        return f"is not in {where}, and HF_HUB_OFFLINE is set: run `{fetch}` where the Hub is reachable, or unset HF_HUB_OFFLINE"
    return f"is not in {where}, and the Hub cannot be reached"


def model_dir(setting: str, repo: str, files: list[str] = MODEL_FILES) -> str:
    """The local snapshot folder of model repo `repo` (downloaded into the cache where it is not
    there and the Hub is reachable); `setting` names the setting in a refusal."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    try:
        return snapshot_download(repo, allow_patterns=files)
    except LocalEntryNotFoundError:
        raise ValueError(f"{setting}: {repo} is no local folder, and the Hub model {repo} "
                         f"{_offline_hint(repo, 'model')}") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{setting}: {repo} is no local folder, and the Hub has no model {repo} that this login "
                         f"can read (private or gated: `hf auth login`)") from None
    except HfHubHTTPError as e:
        raise ValueError(f"{setting}: downloading {repo} from the Hub failed: {e}") from None


def load_dataset(setting: str, repo: str, subset: str | None, split: str):
    """Split `split` of Hub dataset `repo` (its configuration `subset`) as a `datasets.Dataset`.

    datasets reads the Hub, or, offline, what an earlier online load prepared in its own cache; a
    dataset downloaded with `hf download --repo-type dataset` lies in huggingface_hub's cache
    instead, which datasets does not read offline, so that snapshot is read as a local folder."""
    import datasets
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    named = f"{repo}" + (f" (subset {subset})" if subset else "")
    try:
        return datasets.load_dataset(repo, name=subset, split=split)
    except ConnectionError:  # offline, or the Hub unreachable, and not prepared in datasets' cache
        try:
            folder = snapshot_download(repo, repo_type="dataset", local_files_only=True)
        except LocalEntryNotFoundError:
            raise ValueError(f"{setting}: {repo} is no local file or folder, and the Hub dataset {repo} "
                             f"{_offline_hint(repo, 'dataset')}") from None
        return load_folder(setting, folder, subset, split, named)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise ValueError(f"{setting}: {repo} is no local file or folder, and on the Hub: {e}") from None
    except (ValueError, FileNotFoundError) as e:  # an unknown split or subset: datasets lists the ones there are
        raise ValueError(f"{setting}: {named}, split {split}: {e}") from None


def load_folder(setting: str, folder: str, subset: str | None, split: str, named: str | None = None):
    """Split `split` of a dataset repository's files in a local folder (a Hub snapshot or a clone:
    data files, and a README whose `configs` name the subsets), read by `datasets.load_dataset`."""
    import datasets
    try:
        return datasets.load_dataset(folder, name=subset, split=split)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{setting}: {named or folder}, split {split}: {e}") from None
