"""Named configs from a YAML file (ruamel.yaml, anchors and merge keys resolved)."""
import logging
import os

from ruamel.yaml import YAML

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


class YParams:
    """The config `config_name` of `yaml_filename`: read as `params.key` or `params["key"]`."""

    def __init__(self, yaml_filename, config_name, print_params=False):
        self.__dict__["_yaml_filename"] = os.path.abspath(yaml_filename)
        self.__dict__["_config_name"] = config_name
        if not os.path.isfile(yaml_filename):
            raise UserError(f"YAML config file '{yaml_filename}' not found; pass an existing file "
                            "with --yaml_config (e.g. config/ViT.yaml)")
        with open(yaml_filename) as yaml_file:
            all_configs = YAML().load(yaml_file) or {}
        if config_name not in all_configs:
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
