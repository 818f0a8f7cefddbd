namespace ParcelTracker.Domain.Events;

/// <summary>Published (through the outbox) when a parcel is registered.</summary>
public sealed record ParcelCreatedEvent(Guid ParcelId, string TrackingNumber, string Destination);
