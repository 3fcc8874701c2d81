"""Model selection by the config's `model` key."""
from utils.errors import UserError


def get_model(params):
    """Build the network named by `params.model` (default 'vit')."""
    name = params.get("model", "vit")
    if name == "vit":
        from networks.vit import ViT
        return ViT(params)
    raise UserError(f"model '{name}' is unknown; choose one of: vit")
