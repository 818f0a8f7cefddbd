using System.Globalization;
using Microsoft.EntityFrameworkCore;

namespace ParcelTracker.OutsideWorld;

/// <summary>The carrier's API: reserves a pickup slot per call and charges for each. It has no "did I already book this?" query.</summary>
public interface ICarrierApiClient
{
    Task<string> ReservePickupSlotAsync(Guid parcelId, string destination, CancellationToken cancellationToken = default);
}

/// <summary>The SMS gateway: sends one message per call.</summary>
public interface INotificationService
{
    Task SendSmsAsync(Guid parcelId, string text, CancellationToken cancellationToken = default);
}

/// <summary>A carrier stand-in that behaves like the remote service: every call it receives is a reservation, recorded on its own connection.</summary>
public sealed class RecordingCarrierApiClient(IDbContextFactory<OutsideWorldDbContext> outsideWorld, TimeProvider clock) : ICarrierApiClient
{
    public async Task<string> ReservePickupSlotAsync(Guid parcelId, string destination, CancellationToken cancellationToken = default)
    {
        DateTime now = clock.GetUtcNow().UtcDateTime;
        string slot = now.AddDays(1).ToString("yyyy-MM-dd", CultureInfo.InvariantCulture) + "/" + (Math.Abs(parcelId.GetHashCode()) % 8 + 9).ToString("00", CultureInfo.InvariantCulture) + ":00";
        await using var db = await outsideWorld.CreateDbContextAsync(cancellationToken);
        db.CarrierReservations.Add(new CarrierReservation { ParcelId = parcelId, Slot = slot, ReceivedAt = now });
        await db.SaveChangesAsync(cancellationToken);
        return slot;
    }
}

/// <summary>An SMS stand-in: every call it receives is a sent SMS, recorded on its own connection.</summary>
public sealed class RecordingNotificationService(IDbContextFactory<OutsideWorldDbContext> outsideWorld, TimeProvider clock) : INotificationService
{
    public async Task SendSmsAsync(Guid parcelId, string text, CancellationToken cancellationToken = default)
    {
        await using var db = await outsideWorld.CreateDbContextAsync(cancellationToken);
        db.NotificationsSent.Add(new NotificationSent { ParcelId = parcelId, Text = text, ReceivedAt = clock.GetUtcNow().UtcDateTime });
        await db.SaveChangesAsync(cancellationToken);
    }
}
