"""Metrics: latitude-weighted RMSE for ERA5 maps, top-k accuracy for classifiers."""
import torch


def lat_weights(num_lat, device=None):
    """(1, 1, num_lat, 1) weights prop. to cos(latitude), mean 1; rows span +90 .. -90 degrees."""
    lat = torch.linspace(90.0, -90.0, num_lat, device=device, dtype=torch.float64)
    cos_lat = torch.cos(torch.deg2rad(lat)).clamp(min=0.0)  # exact pi: no negative pole weights
    return (num_lat * cos_lat / cos_lat.sum()).float().view(1, 1, num_lat, 1)


def weighted_rmse_channels(pred, target):
    """(B, C): sqrt of the latitude-weighted mean over (H, W) of the squared error."""
    weight = lat_weights(pred.shape[2], device=pred.device)
    return torch.sqrt(torch.mean(weight * (pred.float() - target.float()) ** 2, dim=(-1, -2)))


def era5_valid_metrics(pred, target):
    """Per-sample values to average over the validation set, keyed by TensorBoard tag."""
    return {"RMSE(u10m)/valid": weighted_rmse_channels(pred, target)[:, 0]}


def topk_correct(logits, labels, k):
    """(B,) 1.0 where the label is among the k highest logits."""
    k = min(k, logits.shape[1])
    return (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).float()


def classification_valid_metrics(logits, labels):
    return {"Accuracy/top1/valid": topk_correct(logits, labels, 1),
            "Accuracy/top5/valid": topk_correct(logits, labels, 5)}


def classification_train_metrics(logits, labels):
    return {"Accuracy/top1/train": topk_correct(logits, labels, 1)}


def get_valid_metrics(params):
    """fn(pred, target) -> {tag: (B,) tensor}: validation metrics of the config's model, averaged per sample."""
    model = params.get("model", "vit")
    if model == "vit":
        return era5_valid_metrics
    if model == "resnet":
        return classification_valid_metrics
    return lambda pred, target: {}


def get_train_metrics(params):
    """Like get_valid_metrics, for training batches (averaged over the epoch)."""
    if params.get("model", "vit") == "resnet":
        return classification_train_metrics
    return lambda pred, target: {}
