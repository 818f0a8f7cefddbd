using ExactlyOnce;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using ParcelTracker.Data;
using ParcelTracker.Domain.Events;
using ParcelTracker.OutsideWorld;

namespace ParcelTracker.Consumers;

/// <summary>Sends the "your parcel is registered" SMS and records on the parcel that it was notified.</summary>
[ConsumerIdentity("parcel-tracker.notification")]
public sealed class NotificationConsumer(ParcelDbContext db, INotificationService sms, TimeProvider clock) : IConsumer<ParcelCreatedEvent>
{
    public const string Queue = "parcel-created-notification";

    public async Task Consume(ConsumeContext<ParcelCreatedEvent> context)
    {
        var parcel = await db.Parcels.SingleAsync(p => p.Id == context.Message.ParcelId, context.CancellationToken);
        await sms.SendSmsAsync(parcel.Id, $"Parcel {parcel.TrackingNumber} to {parcel.Destination} is registered.", context.CancellationToken);
        parcel.NotifiedAt = clock.GetUtcNow().UtcDateTime;
        await db.SaveChangesAsync(context.CancellationToken);
    }
}
