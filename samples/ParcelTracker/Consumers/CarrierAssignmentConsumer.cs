using ExactlyOnce;
using ExactlyOnce.Steps;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using ParcelTracker.Data;
using ParcelTracker.Domain.Events;
using ParcelTracker.Hosting;
using ParcelTracker.OutsideWorld;

namespace ParcelTracker.Consumers;

/// <summary>
/// Reserves a carrier pickup slot — a paid, external call — as a recorded step, and stores the slot on the parcel in
/// the inbox transaction. A redelivered message never books again once the booking is recorded; a booking whose
/// outcome is unknown (the process died between the call and the record) goes to the configured policy.
/// </summary>
[ConsumerIdentity("parcel-tracker.carrier-assignment")]
public sealed class CarrierAssignmentConsumer(ParcelDbContext db, ICarrierApiClient carrier, IRecordedSteps steps, CarrierStepPolicy policy, Chaos chaos) : IConsumer<ParcelCreatedEvent>
{
    public const string Queue = "parcel-created-carrier";
    public const string ReserveStep = "reserve-pickup-slot";
    private const int CrashPoints = 4; // before-call, after-call, after-record, after-commit

    public async Task Consume(ConsumeContext<ParcelCreatedEvent> context)
    {
        var parcel = await db.Parcels.SingleAsync(p => p.Id == context.Message.ParcelId, context.CancellationToken);
        parcel.PickupSlot = await steps.RunAsync(ReserveStep, async (idempotencyKey, ct) =>
        {
            await chaos.AtAsync("before-call", Queue, context.MessageId, CrashPoints);
            string slot = await carrier.ReservePickupSlotAsync(parcel.Id, parcel.Destination, idempotencyKey, ct);
            await chaos.AtAsync("after-call", Queue, context.MessageId, CrashPoints);
            return slot;
        }, policy.For(carrier, parcel.Id), context.CancellationToken);
        await chaos.AtAsync("after-record", Queue, context.MessageId, CrashPoints);
        await db.SaveChangesAsync(context.CancellationToken);
    }
}

/// <summary>
/// What the booking step does when its outcome is unknown: <c>--carrier-when-unknown retry|reconcile|park</c>.
/// Default: retry with the same key when the carrier honours keys, reconcile (ask the carrier) when it does not.
/// </summary>
public sealed class CarrierStepPolicy(string mode)
{
    public string Mode { get; } = mode;

    public static CarrierStepPolicy From(IConfiguration configuration, OutsideWorldSettings outsideWorld)
    {
        string mode = (configuration["CarrierWhenUnknown"] ?? (outsideWorld.CarrierHonoursKeys ? "retry" : "reconcile")).ToLowerInvariant();
        return mode is "retry" or "reconcile" or "park"
            ? new CarrierStepPolicy(mode)
            : throw new ArgumentException($"--carrier-when-unknown must be retry, reconcile or park, not '{mode}'.");
    }

    public StepPolicy For(ICarrierApiClient carrier, Guid parcelId) => Mode switch
    {
        "retry" => StepPolicy.RetryWithSameKey,
        "park" => StepPolicy.Park,
        _ => StepPolicy.Reconcile(async (_, ct) => await carrier.FindReservationAsync(parcelId, ct) is { } slot
            ? Reconciliation.Done(slot)
            : Reconciliation.NotDone<string>()),
    };
}
