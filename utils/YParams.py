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


class YParams:
    """The config `config_name` of `yaml_filename`: read as `params.key` or `params["key"]`."""

    def __init__(self, yaml_filename, config_name, print_params=False):
        self.__dict__["_yaml_filename"] = os.path.abspath(yaml_filename)
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
        self.__dict__["params"] = _to_plain(dict(all_configs[config_name]))
        if print_params:
            self.log()

    def __getattr__(self, key):
        try:
            return self.__dict__["params"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self.params[key] = value

    def __getitem__(self, key):
        return self.params[key]

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
