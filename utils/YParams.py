"""Named configs from a YAML file (ruamel.yaml, anchors and merge keys resolved)."""
import glob
import logging
import os

from ruamel.yaml import YAML, YAMLError

from utils.errors import UserError


def _to_plain(value):
    """ruamel's round-trip types -> plain Python (picklable into checkpoints); 'None' -> None."""
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    if isinstance(value, str):
        return None if value == "None" else str(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return value


def read_configs(yaml_filename):
    """The file's named configs as a mapping (empty for an empty file); a syntax error names file and line."""
    try:
        with open(yaml_filename) as yaml_file:
            all_configs = YAML().load(yaml_file)
    except YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"YAML config file '{yaml_filename}' has a syntax error{where}: {problem}") from None
    if all_configs is None:
        return {}
    if not isinstance(all_configs, dict):
        raise UserError(f"YAML config file '{yaml_filename}' is not a mapping of named configs "
                        "(name: {key: value, ...})")
    return all_configs


def _files_holding(config_name, yaml_filename):
    """Other YAML files (beside this one, and in the repository's config/) that define `config_name`."""
    folders = {os.path.dirname(os.path.abspath(yaml_filename)),
               os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")}
    found = []
    for path in sorted({p for folder in folders for p in glob.glob(os.path.join(folder, "*.yaml"))}):
        if os.path.samefile(path, yaml_filename):
            continue
        try:
            if config_name in read_configs(path):
                found.append(os.path.relpath(path))
        except UserError:  # a broken neighbour is not this run's problem
            continue
    return found


def _example_of(key, config_name, model):
    """Where the repository's configs set `key`, in words ("; config/ViT.yaml's tiny sets it: 4"), or '': a config of
    the same model and name first, then of the same model, then any."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for path in sorted(glob.glob(os.path.join(root, "config", "*.yaml"))):
        try:
            configs = read_configs(path)
        except UserError:
            continue
        for name, config in configs.items():
            if isinstance(config, dict) and key in config:
                rank = (config.get("model", "vit") != model, name != config_name)
                found.append((rank, os.path.relpath(path, root), name, _to_plain(config[key])))
    if not found:
        return ""
    _, path, name, value = min(found, key=lambda item: item[0])
    return f"; {path}'s {name} sets it" + (f": {value}" if len(str(value)) <= 40 else "")


class MissingKey(UserError, AttributeError, KeyError):
    """A key the run reads that the config does not hold: one line naming the key, the config and the file (not a
    traceback). Also an AttributeError and a KeyError, so that `getattr(params, key, default)`, `hasattr` and
    `except KeyError` go on working."""

    def __init__(self, key, config_name=None, yaml_filename=None, model="vit"):
        super().__init__(key)
        self.key, self.config_name, self.yaml_filename, self.model = key, config_name, yaml_filename, model

    def __str__(self):  # built when said, not at each hasattr()
        if self.config_name is None:  # re-raised from a loader worker with its text alone (torch's ExceptionWrapper)
            return str(self.key)
        return (f"config '{self.config_name}' in {self.yaml_filename} has no key '{self.key}', which this run "
                f"reads; add `{self.key}: ...` to it{_example_of(self.key, self.config_name, self.model)}")


class YParams:
    """The config `config_name` of `yaml_filename`: read as `params.key` or `params["key"]`; a key it lacks is a
    MissingKey (one line naming key, config and file)."""

    def __init__(self, yaml_filename, config_name, print_params=False):
        self.__dict__["_yaml_filename"] = os.path.abspath(yaml_filename)
        self.__dict__["_yaml_name"] = os.path.normpath(yaml_filename)  # as given, for messages
        self.__dict__["_config_name"] = config_name
        if not os.path.isfile(yaml_filename):
            raise UserError(f"YAML config file '{yaml_filename}' not found; pass an existing file "
                            "with --yaml_config (e.g. config/ViT.yaml)")
        all_configs = read_configs(yaml_filename)
        if not all_configs:
            raise UserError(f"YAML config file '{yaml_filename}' holds no configs; add a named config "
                            "(e.g. `short:` with its keys) or pass another --yaml_config")
        if config_name not in all_configs:
            elsewhere = _files_holding(config_name, yaml_filename)
            if elsewhere:
                raise UserError(f"config '{config_name}' is in {elsewhere[0]}, not "
                                f"{os.path.normpath(yaml_filename)}; add --yaml_config {elsewhere[0]}")
            raise UserError(f"config '{config_name}' is not in {yaml_filename}; "
                            f"choose one of: {', '.join(all_configs)}")
        config = all_configs[config_name]
        if config is None:
            raise UserError(f"config '{config_name}' in {self._yaml_name} is empty; give it its keys, indented under "
                            f"`{config_name}:` (e.g. `  global_batch_size: 64`), or choose another --config")
        if not isinstance(config, dict):
            raise UserError(f"config '{config_name}' in {self._yaml_name} is {_to_plain(config)!r}, not a mapping of "
                            f"keys; write it as `{config_name}:` followed by indented `key: value` lines (as in "
                            "config/ViT.yaml)")
        self.__dict__["params"] = _to_plain(dict(config))
        if print_params:
            self.log()

    def __getattr__(self, key):
        params = self.__dict__.get("params")
        if params is not None and key in params:
            return params[key]
        if params is None or key.startswith("_"):  # pickle and copy probe for hooks (also before __dict__ is set)
            raise AttributeError(key)
        raise self._missing(key)

    def _missing(self, key):
        return MissingKey(key, self.__dict__.get("_config_name"),
                          self.__dict__.get("_yaml_name") or self.__dict__.get("_yaml_filename"),
                          self.__dict__.get("params", {}).get("model", "vit"))

    def __setattr__(self, key, value):
        self.params[key] = value

    def __getitem__(self, key):
        try:
            return self.params[key]
        except KeyError:
            raise self._missing(key) from None

    def __setitem__(self, key, value):
        self.params[key] = value

    def __contains__(self, key):
        return key in self.params

    def get(self, key, default=None):
        return self.params.get(key, default)

    def setdefault(self, key, default):
        return self.params.setdefault(key, default)

    def update(self, new_params):
        self.params.update(new_params)

    @property
    def config_name(self):
        return self._config_name

    def log(self):
        logging.info("------------------ Configuration ------------------")
        logging.info("Configuration file: " + self._yaml_filename)
        logging.info("Configuration name: " + self._config_name)
        for key, value in self.params.items():
            logging.info(f"{key} {value}")
        logging.info("---------------------------------------------------")
