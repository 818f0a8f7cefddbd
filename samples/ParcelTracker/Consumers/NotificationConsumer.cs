using ExactlyOnce;
using ExactlyOnce.Actions;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using ParcelTracker.Data;
using ParcelTracker.Domain.Events;
using ParcelTracker.Hosting;
using ParcelTracker.OutsideWorld;

namespace ParcelTracker.Consumers;

/// <summary>
/// Schedules the "your parcel is registered" SMS as an after-commit action and records on the parcel that it did, in
/// the inbox transaction: the SMS goes out only once that transaction committed, from the outbox dispatcher, always
/// with the same idempotency key.
/// </summary>
[ConsumerIdentity("parcel-tracker.notification")]
public sealed class NotificationConsumer(ParcelDbContext db, IAfterCommitActions actions, TimeProvider clock, Chaos chaos) : IConsumer<ParcelCreatedEvent>
{
    public const string Queue = "parcel-created-notification";

    public async Task Consume(ConsumeContext<ParcelCreatedEvent> context)
    {
        var parcel = await db.Parcels.SingleAsync(p => p.Id == context.Message.ParcelId, context.CancellationToken);
        actions.Schedule(SendParcelSms.Name, new ParcelSms(parcel.Id, $"Parcel {parcel.TrackingNumber} to {parcel.Destination} is registered."));
        parcel.NotifiedAt = clock.GetUtcNow().UtcDateTime;
        await chaos.AtAsync("after-schedule", Queue, context.MessageId, pointsOnPath: 2);
        await db.SaveChangesAsync(context.CancellationToken);
    }
}

/// <summary>The SMS to send for a parcel.</summary>
public sealed record ParcelSms(Guid ParcelId, string Text);

/// <summary>Sends a scheduled SMS through the gateway, passing the action's idempotency key.</summary>
public sealed class SendParcelSms(INotificationService sms, Chaos chaos) : IAfterCommitAction<ParcelSms>
{
    public const string Name = "send-parcel-sms";

    public async Task ExecuteAsync(ParcelSms payload, AfterCommitActionContext context, CancellationToken cancellationToken)
    {
        await sms.SendSmsAsync(payload.ParcelId, payload.Text, context.IdempotencyKey, cancellationToken);
        await chaos.AtAsync("after-action-call", Name, context.IdempotencyKey);
    }
}
