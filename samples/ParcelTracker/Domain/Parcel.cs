namespace ParcelTracker.Domain;

/// <summary>A parcel registered through the API.</summary>
public sealed class Parcel
{
    public Guid Id { get; set; }
    public string TrackingNumber { get; set; } = "";
    public string Destination { get; set; } = "";
    public DateTime CreatedAt { get; set; }

    /// <summary>The carrier pickup slot reserved by <c>CarrierAssignmentConsumer</c>; null until then.</summary>
    public string? PickupSlot { get; set; }

    /// <summary>When <c>NotificationConsumer</c> scheduled the SMS (sent after that commit); null until then.</summary>
    public DateTime? NotifiedAt { get; set; }
}
